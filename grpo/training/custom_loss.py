"""A core loss kernel as the callable PyTRIO's ``forward_backward_custom`` expects.

A user's CISPO is one line::

    client.forward_backward_custom(datums, as_custom_loss("cispo", datums, clip_high_threshold=4.0))

PyTRIO runs a forward on the datums, hands the callable the datums and one leaf log-prob
tensor per datum (``requires_grad``), backpropagates the returned loss and trains on the
gradient. The sampler's log-probs and the advantages never reach the trainer: the callable
reads them from the full datums once, when it is built (``grpo.backends.datums.read_datums``, the
same reader and mask rule as the local backend's built-in losses), so the datums sent may
be stripped to ``target_tokens`` (as the seed article does).

A recipe's own loss (in its package under `grpo.training.recipes`) sits on the same seam: it
checks the log-probs with `checked_logprobs` and pre-scales with `surrogate_divisor`.

PyTRIO trains a custom loss through a cross-entropy surrogate, and a service divides that
surrogate's gradient by its total (docs/FORMULAS.md, "Service normalization"):
``service_normalization`` names the service's divisor D, and the callable returns D times the
kernel's loss, so the gradient applied is the kernel's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from pytrio.types import Datum
from torch import Tensor

from grpo.backends.datums import at_datum, datum_array, read_datums, surrogate_totals
from grpo.core.loss_spec import LossSpec
from grpo.core.losses import LossKernel
from grpo.core.normalization import NORMALIZATIONS, BatchTotals

__all__ = ["CustomLoss", "as_custom_loss", "checked_logprobs", "surrogate_divisor"]


def checked_logprobs(
    data: Sequence[Datum], logprobs_list: Sequence[Tensor], seq_lens: Sequence[int]
) -> Tensor:
    """The per-datum log-probs concatenated, after checking they are the datums the loss was
    built for (count, and each length against ``seq_lens`` and its target_tokens)."""
    num_datums = len(seq_lens)
    if len(logprobs_list) != num_datums or len(data) != num_datums:
        raise ValueError(
            f"got {len(data)} datums and {len(logprobs_list)} logprob tensors but this loss "
            f"was built for {num_datums} datums; build the loss from the datums you train on"
        )
    for index, (datum, logprobs, length) in enumerate(
        zip(data, logprobs_list, seq_lens, strict=True)
    ):
        if logprobs.numel() != length:
            raise ValueError(
                f"logprobs has {logprobs.numel()} entries but target_tokens has {length}"
                f"{at_datum(index)}"
            )
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is not None and len(targets.data) != length:
            raise ValueError(
                f"target_tokens has {len(targets.data)} entries but the loss was built for "
                f"{length}{at_datum(index)}; build the loss from the datums you train on"
            )
    return torch.cat([tensor.reshape(-1) for tensor in logprobs_list])


def surrogate_divisor(
    normalization: str,
    data: Sequence[Datum],
    logprobs_N: Tensor,
    loss_of: Callable[[Tensor], tuple[Tensor, dict[str, float]]],
) -> float:
    """D of pytrio's cross-entropy surrogate (weights −∂loss/∂lp) under ``normalization``: S
    datums, T the non-zero gradients at trained targets (from a second call of ``loss_of`` on
    a copy of the flat log-probs ``logprobs_N``), T_A = 0; a total of 0 gives 1."""
    if normalization != "active_tokens":
        return BatchTotals(len(data), 0, 0).denominator(normalization)
    copy = logprobs_N.detach().clone().requires_grad_(True)
    loss, _ = loss_of(copy)
    if not loss.requires_grad:
        return 1.0
    (gradient,) = torch.autograd.grad(loss, copy, allow_unused=True)
    flat = np.zeros(copy.numel()) if gradient is None else gradient.numpy()
    targets = [datum_array(datum, "target_tokens", np.int64) for datum in data]
    return surrogate_totals([flat], [np.concatenate(targets)]).denominator(normalization)


@attrs.frozen
class CustomLoss:
    """``loss_fn(datums, logprobs_list) -> (loss, metrics)`` over one fixed batch of datums.

    Holds the batch's sampling log-probs, weights (advantages) and mask, packed once; each
    call concatenates the per-datum log-probs and runs the vectorized kernel. Metric keys
    are prefixed with the loss name (``cispo/clip_fraction``). The loss returned is the
    kernel's times the service's divisor D of the surrogate under ``service_normalization``
    (1 under ``sum``); the metrics are the kernel's own.
    """

    spec: LossSpec
    sampling_logprobs: Tensor | None = attrs.field(repr=False)
    weights: Tensor = attrs.field(repr=False)
    mask: Tensor = attrs.field(repr=False)
    seq_lens: tuple[int, ...] = attrs.field(repr=False)
    service_normalization: str = attrs.field(
        default="sum", validator=attrs.validators.in_(NORMALIZATIONS)
    )

    def __call__(
        self, data: Sequence[Datum], logprobs_list: Sequence[Tensor]
    ) -> tuple[Tensor, dict[str, float]]:
        """The kernel's loss and prefixed metrics on the concatenated per-datum log-probs."""
        logprobs = checked_logprobs(data, logprobs_list, self.seq_lens)
        loss, metrics = self._kernel(logprobs)
        divisor = self.service_divisor(data, logprobs)
        prefixed = {f"{self.spec.name}/{key}": value for key, value in metrics.items()}
        return (loss if divisor == 1.0 else loss * divisor), prefixed

    def _kernel(self, logprobs: Tensor) -> tuple[Tensor, dict[str, float]]:
        return self.spec(
            logprobs, self.sampling_logprobs, self.weights, mask=self.mask, seq_lens=self.seq_lens
        )

    def service_divisor(self, data: Sequence[Datum], logprobs: Tensor) -> float:
        """D of pytrio's surrogate under ``service_normalization`` (`surrogate_divisor`)."""
        return surrogate_divisor(self.service_normalization, data, logprobs, self._kernel)


def as_custom_loss(
    loss: str | LossKernel | LossSpec,
    datums: Sequence[Datum],
    *,
    reduction: str = "sum",
    norm_length: float | None = None,
    service_normalization: str = "sum",
    **config: float | None,
) -> CustomLoss:
    """The ``forward_backward_custom`` loss_fn running kernel ``loss`` over these full datums.

    ``loss`` is a kernel name, a kernel, or a ready ``LossSpec`` (then ``reduction``,
    ``norm_length`` and ``config`` must be left out). ``service_normalization`` is the divisor
    of the service it is sent to (the loss is pre-scaled by it; "sum": unscaled). Validates
    the loss and every datum (lengths against target_tokens, finite values where trained)
    here, before any call.
    """
    if isinstance(loss, LossSpec):
        if config or reduction != "sum" or norm_length is not None:
            raise ValueError(
                "as_custom_loss got a LossSpec and loss settings; put the settings in the spec"
            )
        spec = loss
    else:
        spec = LossSpec.build(loss, config, reduction=reduction, norm_length=norm_length)
    arrays = read_datums(
        datums,
        weight_input=spec.kernel.weight_input,
        with_sampling_logprobs=spec.kernel.needs_sampling_logprobs,
    )
    return CustomLoss(
        spec=spec,
        sampling_logprobs=(
            None
            if arrays.sampling_logprobs_N is None
            else torch.from_numpy(arrays.sampling_logprobs_N)
        ),
        weights=torch.from_numpy(arrays.weights_N),
        mask=torch.from_numpy(arrays.mask_N),
        seq_lens=tuple(int(length) for length in arrays.seq_lens_B),
        service_normalization=service_normalization,
    )
