"""Reference sequence log-probs of `grpo dpo`, computed once and kept in the run directory.

log π_ref(y|x) = Σ_t m_t · lp_t of the reference sampler's prompt log-probs of the whole
sequence (one ``compute_logprobs`` per sequence; docs/FORMULAS.md, "Preference
optimization"). `reference_logprobs.json` maps a digest of (the reference, the tokens, the
mask) to the value, so a resumed run (or a rerun on the same pairs) reads them instead of
paying for them again; a sequence not in it is computed and the file rewritten atomically.

The key ties each value to its reference (``base:<model>``, or the weights path) and to its
sequence; the file carries the SHA-256 checksum of its contents (`run_files.
payload_checksum`, as the rollouts sampled ahead), so a file edited by hand or damaged is
not trusted. What cannot be trusted (a file not valid
JSON, of another format, off its checksum; an entry that is not a finite number) is said,
naming the file and the entry, and computed again: the reference is at hand whenever the
run is, and it costs one ``compute_logprobs`` per sequence. A file of a grpo from before
the checksum is used as it is, with a note, and rewritten with one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from pytrio.types import ModelInput

from grpo.backends.clients import Sampler
from grpo.backends.pytrio import call_with_retries
from grpo.core.sft import SftExample
from grpo.training.run import run_files

CACHE_FILE = "reference_logprobs.json"
FORMAT = "grpo-reference-logprobs/2"
"""With the checksum of its contents; "/1" (older grpo) had none."""
_UNCHECKED_FORMAT = "grpo-reference-logprobs/1"


def sequence_key(reference: str, example: SftExample) -> str:
    """The cache key of ``example`` under ``reference``: sha256 of both, tokens and mask."""
    digest = hashlib.sha256(reference.encode("utf-8"))
    digest.update(np.ascontiguousarray(example.tokens_T, dtype=np.int64).tobytes())
    digest.update(np.packbits(example.mask_T).tobytes())
    return digest.hexdigest()


def read_cache(run_dir: Path, note: Callable[[str], None]) -> tuple[dict[str, float], bool]:
    """(the cached values of ``run_dir`` that can be trusted, whether the file must be
    rewritten); what is not trusted is noted naming the file (and the entry), never used."""
    path = run_dir / CACHE_FILE
    if not path.is_file():
        return {}, False
    again = "its reference log-probs are computed again and the file rewritten"
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        note(f"{path} cannot be read as JSON ({error}); {again}")
        return {}, True
    if not isinstance(payload, dict) or not isinstance(payload.get("logprobs"), dict):
        note(f"{path} holds no 'logprobs' object (damaged); {again}")
        return {}, True
    unchecked = payload.get("format") == _UNCHECKED_FORMAT and "checksum" not in payload
    if unchecked:
        note(
            f"{path} was written by a grpo from before reference caches had a checksum: its "
            "values are used as they are and the file is rewritten with one"
        )
    elif payload.get("format") != FORMAT:
        note(f"{path} is of format {payload.get('format')!r}, not {FORMAT!r}; {again}")
        return {}, True
    elif payload.pop("checksum", None) != run_files.payload_checksum(payload):
        note(f"{path} does not match its checksum (edited by hand or damaged); {again}")
        return {}, True
    cache, bad = {}, []
    for key, value in payload["logprobs"].items():
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        if finite and math.isfinite(value):
            cache[key] = float(value)
        else:
            bad.append(f"entry {key!r} holds {json.dumps(value)[:40]}")
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        note(
            f"{path}: {bad[0]}{more}, not a log-prob (a finite number); those entries are "
            "computed again and the file rewritten"
        )
    return cache, unchecked or bool(bad)


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
    sampler: Sampler,
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
    cache, rewrite = read_cache(run_dir, note)
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
            note=note,
        )
        return masked_sum(values, example)

    if missing:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            computed = list(pool.map(one, missing))
        cache.update({keys[i]: value for i, value in zip(missing, computed)})
    if missing or rewrite:
        payload = {"format": FORMAT, "reference": reference, "logprobs": cache}
        checksum = run_files.payload_checksum(payload)
        run_files.write_json_atomic(run_dir / CACHE_FILE, {**payload, "checksum": checksum})
    sent = sum(int(examples[i].tokens_T.size) for i in missing)
    return np.array([cache[key] for key in keys], dtype=np.float64), sent
