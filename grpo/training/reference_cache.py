"""Reference sequence log-probs of `grpo dpo`, computed once and kept in the run directory.

log π_ref(y|x) = Σ_t m_t · lp_t of the reference sampler's prompt log-probs of the whole
sequence (one ``compute_logprobs`` per sequence; docs/FORMULAS.md, "Preference
optimization"). `reference_logprobs.json` maps a digest of (the reference, the tokens, the
mask) to the value, so a resumed run (or a rerun on the same pairs) reads them instead of
paying for them again; a sequence not in it is computed and the file rewritten atomically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from pytrio.types import ModelInput

from grpo.backends.pytrio import call_with_retries
from grpo.core.sft import SftExample
from grpo.training import run_files

CACHE_FILE = "reference_logprobs.json"
FORMAT = "grpo-reference-logprobs/1"


def sequence_key(reference: str, example: SftExample) -> str:
    """The cache key of ``example`` under ``reference``: sha256 of both, tokens and mask."""
    digest = hashlib.sha256(reference.encode("utf-8"))
    digest.update(np.ascontiguousarray(example.tokens_T, dtype=np.int64).tobytes())
    digest.update(np.packbits(example.mask_T).tobytes())
    return digest.hexdigest()


def read_cache(run_dir: Path) -> dict[str, float]:
    """The cached values of ``run_dir`` (empty when there is no cache yet)."""
    path = run_dir / CACHE_FILE
    if not path.is_file():
        return {}
    payload = run_files.read_json(path, what="reference log-prob cache")
    return {str(key): float(value) for key, value in payload.get("logprobs", {}).items()}


def masked_sum(logprobs_T: Sequence[float | None], example: SftExample) -> float:
    """Σ_t m_t · lp_t of a sampler's prompt log-probs (entry 0, predicted by nothing, is None)."""
    if len(logprobs_T) != example.tokens_T.size:
        raise ValueError(
            f"the reference returned {len(logprobs_T)} log-probs for {example.tokens_T.size} tokens"
        )
    values = np.array([lp for lp, m in zip(logprobs_T, example.mask_T) if m], dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("the reference returned a non-finite log-prob on a completion token")
    return float(values.sum())


def reference_logprobs(
    run_dir: Path,
    reference: str,
    sampler: Any,
    examples: Sequence[SftExample],
    *,
    concurrency: int,
    max_retries: int,
    note: Callable[[str], None],
) -> tuple[np.ndarray, int]:
    """log π_ref(y|x) of every example (float64), and the tokens newly sent to the reference.

    Cached values are read from ``run_dir``; the rest are computed (``concurrency`` requests
    in flight) and written back before returning.
    """
    cache = read_cache(run_dir)
    keys = [sequence_key(reference, example) for example in examples]
    missing = sorted({key: i for i, key in enumerate(keys) if key not in cache}.values())

    def one(index: int) -> float:
        example = examples[index]
        values = call_with_retries(
            lambda: sampler.compute_logprobs(
                ModelInput.from_ints(example.tokens_T.tolist())
            ).result(),
            what="reference compute_logprobs",
            max_retries=max_retries,
            on_retry=note,
        )
        return masked_sum(values, example)

    if missing:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            computed = list(pool.map(one, missing))
        cache.update({keys[i]: value for i, value in zip(missing, computed)})
        run_files.write_json_atomic(
            run_dir / CACHE_FILE, {"format": FORMAT, "reference": reference, "logprobs": cache}
        )
    sent = sum(int(examples[i].tokens_T.size) for i in missing)
    return np.array([cache[key] for key in keys], dtype=np.float64), sent
