"""The Datum boundary: packed token batches to PyTRIO `Datum`s, and datums back to arrays.

Everything that knows how a `Datum` is laid out lives here, once:

- the ignore index (a target of ``IGNORE_INDEX`` trains nothing) and the mask rule
  (``datum_mask``: ``mask != 0`` if a ``mask`` entry is present, else the weight input
  ``!= 0``, never an ignored target), shared by the local backend's built-in losses and
  `as_custom_loss`, so both mask identically;
- ``read_datums``: datums to the flat arrays a loss kernel takes (one reader for the local
  backend and the custom-loss adapter);
- ``datum_totals``: a logical batch's totals S, T, T_A as pytrio's planner counts them, and
  ``surrogate_totals`` those of a custom loss's cross-entropy surrogate; ``scale_weights``
  multiplies the datums' weights, so a loop can pre-scale for the service's divisor
  (docs/FORMULAS.md, "Service normalization");
- ``batch_to_datums``: a core `TokenBatch` to datums, masked-out targets (the prompt) as
  ``IGNORE_INDEX``, so that pytrio's planner counts as active exactly the trained tokens.
  Its arrays come from validated core records, so it builds the pydantic objects with
  ``model_construct``, skipping a second per-element validation that costs more than
  everything else on the client at a million tokens (``benchmarks/datums.py``); the result
  equals a validated construction.

Backends may import this module (and the core); see docs/DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from pytrio.types import Datum, EncodedTextChunk, ModelInput, TensorData

from grpo.core.normalization import BatchTotals
from grpo.core.records import TokenBatch

POLICY_INPUT_KEYS = ("target_tokens", "logprobs", "advantages")

IGNORE_INDEX = -100
"""A target token equal to this trains nothing (the usual label-padding convention)."""


def at_datum(index: int | None) -> str:
    """The suffix that names a datum in an error message: `` (datum 3)``, or nothing."""
    return "" if index is None else f" (datum {index})"


def datum_array(
    datum: Datum, key: str, dtype: type[np.generic], index: int | None = None
) -> np.ndarray:
    """``loss_fn_inputs[key]`` as a flat numpy array, or a ValueError naming what is missing."""
    try:
        tensor = datum.loss_fn_inputs[key]
    except KeyError:
        present = ", ".join(sorted(datum.loss_fn_inputs)) or "nothing"
        raise ValueError(
            f"loss_fn_inputs has no {key!r}{at_datum(index)} (it holds {present}); pass the "
            f"full datums (before stripping them to target_tokens)"
        ) from None
    # TensorData keeps a flat Python list; one asarray beats any per-element conversion.
    return np.asarray(tensor.data, dtype=dtype)


def _check_length(name: str, values: np.ndarray, num_targets: int, index: int | None) -> None:
    if values.size != num_targets:
        raise ValueError(
            f"{name} has {values.size} entries but target_tokens has {num_targets}{at_datum(index)}"
        )


def _check_finite(name: str, values: np.ndarray, mask: np.ndarray, index: int | None) -> None:
    bad = mask & ~np.isfinite(values)
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} holds {values[position]} at position {position}{at_datum(index)}; "
            "every entry at a trained position must be finite"
        )


def _mask(
    datum: Datum, targets: np.ndarray, weights: np.ndarray, weight_input: str, index: int | None
) -> np.ndarray:
    if "mask" in datum.loss_fn_inputs:
        name, selector = "mask", datum_array(datum, "mask", np.float32, index)
    else:
        name, selector = weight_input, weights
    _check_length(name, selector, targets.size, index)
    if name == "mask":
        not_binary = (selector != 0) & (selector != 1)
        if not_binary.any():
            position = int(np.flatnonzero(not_binary)[0])
            raise ValueError(
                f"mask holds {selector[position]} at position {position}{at_datum(index)}, but "
                "a mask holds only 0 and 1; to weight positions, scale the advantages instead"
            )
    return (selector != 0) & (targets != IGNORE_INDEX)


def _weights(
    datum: Datum, weight_input: str, num_targets: int, optional: bool, index: int | None
) -> np.ndarray:
    if optional and weight_input not in datum.loss_fn_inputs:
        return np.ones(num_targets, dtype=np.float32)
    weights = datum_array(datum, weight_input, np.float32, index)
    _check_length(weight_input, weights, num_targets, index)
    return weights


def datum_mask(
    datum: Datum, *, weight_input: str = "advantages", weights_optional: bool = False
) -> np.ndarray:
    """Training positions of a datum: ``mask == 1`` if it has a ``mask`` entry (of 0s and 1s:
    anything else raises ValueError), else ``weight_input != 0`` (absent optional weights
    count as 1); never an IGNORE_INDEX target."""
    targets = datum_array(datum, "target_tokens", np.int64)
    weights = _weights(datum, weight_input, targets.size, weights_optional, None)
    return _mask(datum, targets, weights, weight_input, None)


@attrs.frozen
class DatumArrays:
    """Datums as flat arrays over all their target positions (N), datum by datum (B)."""

    target_tokens_B: list[np.ndarray]
    sampling_logprobs_N: np.ndarray | None
    weights_N: np.ndarray
    mask_N: np.ndarray
    seq_lens_B: np.ndarray


def read_datums(
    datums: Sequence[Datum],
    *,
    weight_input: str = "advantages",
    with_sampling_logprobs: bool = True,
    weights_optional: bool = False,
) -> DatumArrays:
    """Targets, sampling log-probs, weights and the mask rule's mask of every datum, flattened.

    ValueError naming the datum when an entry is missing, has the wrong length, or holds a
    non-finite value at a trained position.
    """
    targets_B, logprobs_B, weights_B, masks_B = [], [], [], []
    for index, datum in enumerate(datums):
        targets = datum_array(datum, "target_tokens", np.int64, index)
        weights = _weights(datum, weight_input, targets.size, weights_optional, index)
        mask = _mask(datum, targets, weights, weight_input, index)
        _check_finite(weight_input, weights, mask, index)
        if with_sampling_logprobs:
            logprobs = datum_array(datum, "logprobs", np.float32, index)
            _check_length("logprobs", logprobs, targets.size, index)
            _check_finite("logprobs", logprobs, mask, index)
            logprobs_B.append(logprobs)
        targets_B.append(targets)
        weights_B.append(weights)
        masks_B.append(mask)
    if not targets_B:
        raise ValueError("datums is empty; pass the datums you are about to train on")
    return DatumArrays(
        target_tokens_B=targets_B,
        sampling_logprobs_N=np.concatenate(logprobs_B) if with_sampling_logprobs else None,
        weights_N=np.concatenate(weights_B),
        mask_N=np.concatenate(masks_B),
        seq_lens_B=np.array([targets.size for targets in targets_B], dtype=np.int64),
    )


def _tensor(values: np.ndarray, dtype: str) -> TensorData:
    """A TensorData over already-checked 1-D values (no re-validation)."""
    return TensorData.model_construct(
        data=values.tolist(), dtype=dtype, shape=[int(values.shape[0])]
    )


def _model_input(tokens: np.ndarray) -> ModelInput:
    """A one-chunk ModelInput over already-checked token ids."""
    chunk = EncodedTextChunk.model_construct(tokens=tokens.tolist(), type="encoded_text")
    return ModelInput.model_construct(chunks=[chunk])


def batch_to_datums(batch: TokenBatch, *, with_mask: bool = False) -> list[Datum]:
    """One policy-loss Datum per packed sequence: input tokens plus target/logprobs/advantages,
    the target IGNORE_INDEX wherever the batch's mask is 0 (so the service's active-token
    count is the trained-token count).

    ``with_mask`` adds the batch's mask as a ``mask`` entry, so a masked-in token whose
    advantage is 0 still trains (counts in a mean's denominator; docs/FORMULAS.md).
    """
    offsets = np.cumsum(batch.seq_lens)[:-1]
    inputs = np.split(np.asarray(batch.input_tokens, dtype=np.int64), offsets)

    def split(values: object, dtype: type) -> list[np.ndarray]:
        return np.split(np.asarray(values, dtype=dtype), offsets)

    # Positions the mask leaves out (the prompt) get the ignore index: pytrio's planner, and
    # so the service, counts every other target as active (docs/FORMULAS.md, "Service
    # normalization"); the local backend trains the same positions either way.
    targets = np.where(np.asarray(batch.mask) != 0, batch.target_tokens, IGNORE_INDEX)
    columns = {
        "target_tokens": (split(targets, np.int64), "int64"),
        "logprobs": (split(batch.sampling_logprobs, np.float32), "float32"),
        "advantages": (split(batch.advantages, np.float32), "float32"),
    }
    if with_mask:
        columns["mask"] = (split(batch.mask, np.float32), "float32")
    return [
        Datum.model_construct(
            model_input=_model_input(input_tokens),
            loss_fn_inputs={
                key: _tensor(parts[index], dtype) for key, (parts, dtype) in columns.items()
            },
        )
        for index, input_tokens in enumerate(inputs)
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
    """The per-datum `logprobs` a forward/forward_backward returned, as one flat array."""
    missing = [index for index, output in enumerate(loss_fn_outputs) if "logprobs" not in output]
    if missing:
        raise ValueError(
            f"backend output has no 'logprobs' for datums {missing[:5]}; "
            "cannot compute ratio statistics"
        )
    return np.concatenate(
        [np.asarray(output["logprobs"].data, dtype=np.float32) for output in loss_fn_outputs]
    )


def datum_totals(
    datums: Sequence[Datum], *, loss_fn: str = "importance_sampling", auto_shift: bool = False
) -> BatchTotals:
    """S, T, T_A of a logical batch as pytrio 0.2.9's planner counts them: T the targets not
    IGNORE_INDEX (from position 1 under `auto_shift`; for ``cross_entropy`` only those with a
    non-zero weight, absent weights counting 1), T_A those of T with a non-zero advantage (0
    for ``cross_entropy``)."""
    cross_entropy = loss_fn.strip().lower() == "cross_entropy"
    active = advantage = 0
    for datum in datums:
        targets = datum_array(datum, "target_tokens", np.int64)
        counted = targets != IGNORE_INDEX
        if auto_shift:
            counted[:1] = False
        if cross_entropy:
            if "weights" in datum.loss_fn_inputs:
                counted &= datum_array(datum, "weights", np.float64) != 0
        else:
            advantage += int((counted & (datum_array(datum, "advantages", np.float64) != 0)).sum())
        active += int(counted.sum())
    return BatchTotals(samples=len(datums), active_tokens=active, advantage_tokens=advantage)


def surrogate_totals(
    gradients_B: Sequence[np.ndarray], targets_B: Sequence[np.ndarray]
) -> BatchTotals:
    """The totals of pytrio's cross-entropy surrogate of a custom loss (weights −gradient):
    S datums, T the non-zero gradients at targets not IGNORE_INDEX, T_A = 0."""
    active = sum(
        int(((np.asarray(gradient) != 0) & (np.asarray(targets) != IGNORE_INDEX)).sum())
        for gradient, targets in zip(gradients_B, targets_B, strict=True)
    )
    return BatchTotals(samples=len(gradients_B), active_tokens=active, advantage_tokens=0)


def scale_weights(datums: Sequence[Datum], factor: float, weight_input: str) -> list[Datum]:
    """The datums with ``loss_fn_inputs[weight_input]`` times `factor` (float32, as sent; an
    absent weight counts 1, as cross-entropy's does); the datums themselves when `factor` is
    1. Every other entry is shared, not copied."""
    if factor == 1.0:
        return list(datums)
    scaled = []
    for datum in datums:
        inputs = dict(datum.loss_fn_inputs)
        if weight_input in inputs:
            values = datum_array(datum, weight_input, np.float64)
        else:
            values = np.ones(len(inputs["target_tokens"].data), dtype=np.float64)
        inputs[weight_input] = _tensor((values * factor).astype(np.float32), "float32")
        scaled.append(Datum.model_construct(model_input=datum.model_input, loss_fn_inputs=inputs))
    return scaled
