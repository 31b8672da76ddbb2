"""Packed token batches to PyTRIO `Datum`s, and back.

The arrays come from validated core records (`TokenBatch`), so the fast path builds the
pydantic objects with `model_construct`, skipping a second per-element validation that
costs more than everything else on the client at a million tokens (see
`benchmarks/datums.py`). The result is the same object a validated construction gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pytrio.types import Datum, EncodedTextChunk, ModelInput, TensorData

from grpo.core.records import TokenBatch

POLICY_INPUT_KEYS = ("target_tokens", "logprobs", "advantages")


def _tensor(values: np.ndarray, dtype: str) -> TensorData:
    """A TensorData over already-checked 1-D values (no re-validation)."""
    return TensorData.model_construct(data=values.tolist(), dtype=dtype, shape=[int(values.shape[0])])


def _model_input(tokens: np.ndarray) -> ModelInput:
    """A one-chunk ModelInput over already-checked token ids."""
    chunk = EncodedTextChunk.model_construct(tokens=tokens.tolist(), type="encoded_text")
    return ModelInput.model_construct(chunks=[chunk])


def batch_to_datums(batch: TokenBatch) -> list[Datum]:
    """One policy-loss Datum per packed sequence: input tokens plus target/logprobs/advantages."""
    offsets = np.cumsum(batch.seq_lens)[:-1]
    inputs = np.split(np.asarray(batch.input_tokens, dtype=np.int64), offsets)
    targets = np.split(np.asarray(batch.target_tokens, dtype=np.int64), offsets)
    logprobs = np.split(np.asarray(batch.sampling_logprobs, dtype=np.float32), offsets)
    advantages = np.split(np.asarray(batch.advantages, dtype=np.float32), offsets)
    return [
        Datum.model_construct(
            model_input=_model_input(input_tokens),
            loss_fn_inputs={
                "target_tokens": _tensor(target_tokens, "int64"),
                "logprobs": _tensor(sampling_logprobs, "float32"),
                "advantages": _tensor(token_advantages, "float32"),
            },
        )
        for input_tokens, target_tokens, sampling_logprobs, token_advantages in zip(
            inputs, targets, logprobs, advantages, strict=True
        )
    ]


def forward_only(datums: Sequence[Datum]) -> list[Datum]:
    """Datums stripped to `target_tokens`, what a custom-loss forward needs (as in the article)."""
    return [
        Datum.model_construct(
            model_input=datum.model_input,
            loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]},
        )
        for datum in datums
    ]


def output_logprobs(loss_fn_outputs: Sequence[dict[str, TensorData]]) -> np.ndarray:
    """Concatenate the per-datum `logprobs` a forward/forward_backward returned into one flat array."""
    missing = [index for index, output in enumerate(loss_fn_outputs) if "logprobs" not in output]
    if missing:
        raise ValueError(f"backend output has no 'logprobs' for datums {missing[:5]}; cannot compute ratio statistics")
    return np.concatenate([np.asarray(output["logprobs"].data, dtype=np.float32) for output in loss_fn_outputs])
