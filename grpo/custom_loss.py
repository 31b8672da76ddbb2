"""A core loss kernel as the callable PyTRIO's ``forward_backward_custom`` expects.

A user's CISPO is one line::

    client.forward_backward_custom(datums, as_custom_loss("cispo", datums, clip_high_threshold=4.0))

PyTRIO runs a forward on the datums, hands the callable the datums and one leaf log-prob
tensor per datum (``requires_grad``), backpropagates the returned loss and trains on the
gradient. The sampler's log-probs and the advantages never reach the trainer: the callable
reads them from the full datums once, when it is built, so the datums sent may be
stripped to ``target_tokens`` (as the seed article does).

``datum_mask`` is the one rule deciding which positions train; the local backend uses it
too, so its built-in losses and custom losses mask identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from pytrio.types import Datum
from torch import Tensor

from grpo.core.losses import LossKernel, get_loss, validate_reduction

__all__ = ["IGNORE_INDEX", "CustomLoss", "as_custom_loss", "datum_mask"]

IGNORE_INDEX = -100
"""A target token equal to this trains nothing (the usual label-padding convention)."""


def _at_datum(index: int | None) -> str:
    return "" if index is None else f" (datum {index})"


def _input(datum: Datum, key: str, dtype: type[np.generic], index: int | None) -> np.ndarray:
    """loss_fn_inputs[key] as a flat numpy array, or a ValueError naming what is missing."""
    try:
        tensor = datum.loss_fn_inputs[key]
    except KeyError:
        present = ", ".join(sorted(datum.loss_fn_inputs)) or "nothing"
        raise ValueError(
            f"loss_fn_inputs has no {key!r}{_at_datum(index)} (it holds {present}); build the "
            "custom loss from the full datums, before stripping them to target_tokens"
        ) from None
    # TensorData keeps a flat Python list; one asarray beats any per-element conversion.
    return np.asarray(tensor.data, dtype=dtype)


def _check_length(name: str, values: np.ndarray, num_targets: int, index: int | None) -> None:
    if values.size != num_targets:
        raise ValueError(
            f"{name} has {values.size} entries but target_tokens has "
            f"{num_targets}{_at_datum(index)}"
        )


def _datum_mask(
    datum: Datum,
    targets: np.ndarray,
    weights: np.ndarray | None,
    weight_input: str,
    index: int | None,
) -> np.ndarray:
    if "mask" in datum.loss_fn_inputs:
        name, selector = "mask", _input(datum, "mask", np.float32, index)
    elif weights is not None:
        name, selector = weight_input, weights
    else:
        name, selector = weight_input, _input(datum, weight_input, np.float32, index)
    _check_length(name, selector, targets.size, index)
    if name == "mask":
        not_binary = (selector != 0) & (selector != 1)
        if not_binary.any():
            position = int(np.flatnonzero(not_binary)[0])
            raise ValueError(
                f"mask holds {selector[position]} at position {position}{_at_datum(index)}, but "
                "a mask holds only 0 and 1; to weight positions, scale the advantages instead"
            )
    return (selector != 0) & (targets != IGNORE_INDEX)


def datum_mask(datum: Datum, *, weight_input: str = "advantages") -> np.ndarray:
    """Training positions of a datum: ``mask == 1`` if it has a ``mask`` entry (of 0s and 1s:
    anything else raises ValueError), else ``weight_input != 0`` (advantages; weights for
    cross_entropy); never a target of −100."""
    targets = _input(datum, "target_tokens", np.int64, None)
    return _datum_mask(datum, targets, None, weight_input, None)


def _check_finite(name: str, values: np.ndarray, index: int) -> None:
    if not np.all(np.isfinite(values)):
        position = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValueError(
            f"{name} holds {values[position]} at position {position}{_at_datum(index)}; "
            "every entry must be finite"
        )


@attrs.frozen
class CustomLoss:
    """``loss_fn(datums, logprobs_list) -> (loss, metrics)`` over one fixed batch of datums.

    Holds the batch's sampling log-probs, weights (advantages) and mask, packed once; each
    call concatenates the per-datum log-probs and runs the vectorized kernel. Metric keys
    are prefixed with the loss name (``cispo/clip_fraction``).
    """

    kernel: LossKernel
    config: dict[str, float | None]
    reduction: str
    norm_length: float | None
    sampling_logprobs: Tensor | None = attrs.field(repr=False)
    weights: Tensor = attrs.field(repr=False)
    mask: Tensor = attrs.field(repr=False)
    seq_lens: tuple[int, ...] = attrs.field(repr=False)

    def __call__(
        self, data: Sequence[Datum], logprobs_list: Sequence[Tensor]
    ) -> tuple[Tensor, dict[str, float]]:
        """The kernel's loss and prefixed metrics on the concatenated per-datum log-probs."""
        num_datums = len(self.seq_lens)
        if len(logprobs_list) != num_datums or len(data) != num_datums:
            raise ValueError(
                f"got {len(data)} datums and {len(logprobs_list)} logprob tensors but this loss "
                f"was built for {num_datums} datums; build as_custom_loss from the datums you "
                "train on"
            )
        checked = zip(data, logprobs_list, self.seq_lens, strict=True)
        for index, (datum, logprobs, length) in enumerate(checked):
            if logprobs.numel() != length:
                raise ValueError(
                    f"logprobs has {logprobs.numel()} entries but target_tokens has {length}"
                    f"{_at_datum(index)}"
                )
            targets = datum.loss_fn_inputs.get("target_tokens")
            if targets is not None and len(targets.data) != length:
                raise ValueError(
                    f"target_tokens has {len(targets.data)} entries but the loss was built for "
                    f"{length}{_at_datum(index)}; build as_custom_loss from the datums you train on"
                )
        logprobs = torch.cat([tensor.reshape(-1) for tensor in logprobs_list])
        loss, metrics = self.kernel(
            logprobs,
            self.sampling_logprobs,
            self.weights,
            mask=self.mask,
            seq_lens=self.seq_lens,
            reduction=self.reduction,
            norm_length=self.norm_length,
            **self.config,
        )
        return loss, {f"{self.kernel.name}/{key}": value for key, value in metrics.items()}


def as_custom_loss(
    loss: str | LossKernel,
    datums: Sequence[Datum],
    *,
    reduction: str = "sum",
    norm_length: float | None = None,
    **config: float | None,
) -> CustomLoss:
    """The ``forward_backward_custom`` loss_fn running kernel ``loss`` over these full datums.

    Validates the loss name, config and reduction and every datum (lengths against
    target_tokens, finite values) here, before any remote call.
    """
    kernel = loss if isinstance(loss, LossKernel) else get_loss(loss)
    resolved = kernel.resolve(config)
    validate_reduction(reduction, norm_length)
    if len(datums) == 0:
        raise ValueError("datums is empty; pass the full datums you are about to train on")
    sampling_logprobs, weights, masks, seq_lens = [], [], [], []
    for index, datum in enumerate(datums):
        targets = _input(datum, "target_tokens", np.int64, index)
        datum_weights = _input(datum, kernel.weight_input, np.float32, index)
        _check_length(kernel.weight_input, datum_weights, targets.size, index)
        _check_finite(kernel.weight_input, datum_weights, index)
        if kernel.needs_sampling_logprobs:
            datum_logprobs = _input(datum, "logprobs", np.float32, index)
            _check_length("logprobs", datum_logprobs, targets.size, index)
            _check_finite("logprobs", datum_logprobs, index)
            sampling_logprobs.append(datum_logprobs)
        weights.append(datum_weights)
        masks.append(_datum_mask(datum, targets, datum_weights, kernel.weight_input, index))
        seq_lens.append(targets.size)
    return CustomLoss(
        kernel=kernel,
        config=resolved,
        reduction=reduction,
        norm_length=norm_length,
        sampling_logprobs=(
            torch.from_numpy(np.concatenate(sampling_logprobs)) if sampling_logprobs else None
        ),
        weights=torch.from_numpy(np.concatenate(weights)),
        mask=torch.from_numpy(np.concatenate(masks)),
        seq_lens=tuple(seq_lens),
    )
