"""A loss kernel's inputs, checked and packed into units (docs/FORMULAS.md, Notation).

Provides ``validate`` (a kernel call's tensors checked into ``Inputs``: flat detached
values in the compute dtype, the mask as a selection, ``seq_lens`` as int64), ``pack`` and
``pack_finite`` (``Inputs`` as token ``Units``, the log-ratio and the advantages masked),
``nonfinite_error`` (the error naming the first bad masked-in value) and the small tensor
helpers the kernels share (``segment_sum``, ``as_float``, ``count_true``).

Masked positions contribute nothing to the loss or the gradient, whatever they hold
(NaN and ±inf included): the log-ratio and the advantage are replaced by 0 there *before*
``exp``, so an overflowing ratio on a prompt position cannot turn into NaN. An empty
selection gives loss 0 with a zero gradient.

Numbers never poison a step: a NaN or ±inf in ``logprobs``, ``sampling_logprobs`` or the
advantages (weights) at a masked-in position, and a mask value other than 0 and 1, raise
a ValueError naming the tensor and the first bad index (``sampling_logprobs[17] is nan at
a masked-in position``). The check costs one inner product on the eager path and an add
and a multiply a position inside the fused form's single loop; the index is only
searched for when it fails.

float16 and bfloat16 inputs are computed in float32: the loss is float32 and the gradient
flows back to ``logprobs`` in its own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    SeqLens: TypeAlias = Tensor | Sequence[int] | ArrayLike

__all__ = [
    "LOW_PRECISION_DTYPES",
    "Inputs",
    "Units",
    "as_float",
    "count_true",
    "nonfinite_error",
    "pack",
    "pack_finite",
    "segment_sum",
    "validate",
]

# At a million tokens every float temporary costs a pass over memory and, when the
# allocator hands back fresh pages, a page fault per 4 KiB: the kernels work in place on
# the temporaries they own and compute gradients in closed form, without autograd's
# saved intermediates.


class Units(NamedTuple):
    """Validated kernel inputs as plain values (no autograd), one entry per unit.

    A unit is a token, or a sequence for GSPO. ``log_ratio`` and ``advantages`` are
    already 0 on masked-out units, so r = 1 there exactly and every objective built from
    them is exactly 0 there. ``log_ratio`` is the kernel's own temporary: the objective
    may overwrite it. ``logprobs`` and ``advantages`` may be the caller's tensors.
    (A NamedTuple, not an attrs class: torch.compile cannot trace attrs' frozen __init__.)
    """

    logprobs: Tensor | None  # lp values, detached; None for sequence units
    log_ratio: Tensor | None
    advantages: Tensor
    selected: Tensor | None  # bool mask; None when every unit trains
    mask: Tensor | None  # the same mask as 0.0/1.0 in the data's dtype
    seq_lens: Tensor  # int64 units per sequence, on the data's device
    unit_count: int  # masked-in units
    token_count: int  # masked-in tokens
    tokens_per_unit: Tensor | None = None  # sequence units: n_i clamped to >= 1

    @property
    def masked_out(self) -> int:
        """Units that do not train (each holds r = 1 and A = 0)."""
        return self.advantages.numel() - self.unit_count

    def counts_per_sequence(self) -> Tensor:
        """n_i: masked-in units of each sequence, in the data's float dtype."""
        if self.mask is None:
            return self.seq_lens.to(self.advantages.dtype)
        return segment_sum(self.mask, self.seq_lens)

    def per_sequence(self) -> Units:
        """One unit per sequence: masked mean log-ratio and masked mean advantage A_i."""
        tokens_per_sequence = self.counts_per_sequence()
        denominator = tokens_per_sequence.clamp(min=1)
        has_tokens = tokens_per_sequence > 0
        num_trained = int(has_tokens.count_nonzero())
        all_trained = num_trained == has_tokens.numel()
        # Only the sequence-level kernel asks for this, and it requires lp_old.
        assert self.log_ratio is not None
        return Units(
            logprobs=None,
            log_ratio=segment_sum(self.log_ratio, self.seq_lens) / denominator,
            advantages=segment_sum(self.advantages, self.seq_lens) / denominator,
            selected=None if all_trained else has_tokens,
            mask=None if all_trained else has_tokens.to(self.advantages.dtype),
            seq_lens=torch.ones_like(self.seq_lens),
            unit_count=num_trained,
            token_count=self.token_count,
            tokens_per_unit=denominator,
        )


def segment_sum(values_N: Tensor, seq_lens_B: Tensor) -> Tensor:
    """Σ of values over each consecutive segment (no Python loop)."""
    return torch.segment_reduce(values_N, "sum", lengths=seq_lens_B)


def as_float(selected: Tensor, out: Tensor) -> Tensor:
    """A bool tensor as 0.0/1.0, written into ``out``.

    Read through a uint8 view: the bool cast takes a scalar loop ~5x slower, as does every
    bool-conditioned op (where, masked_fill, float × bool); a float multiply does not.
    """
    return out.copy_(selected.view(torch.uint8))


def _as_seq_lens(seq_lens: SeqLens | None, num_tokens: int, device: torch.device) -> Tensor:
    if seq_lens is None:
        return torch.tensor([num_tokens], dtype=torch.int64, device=device)
    lengths = torch.as_tensor(seq_lens)
    if lengths.numel() == 0:
        # No sequences at all is one empty sequence: both select nothing.
        lengths = torch.zeros(1, dtype=torch.int64)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"seq_lens must hold integers, got dtype {lengths.dtype}")
    if lengths.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D, got shape {tuple(lengths.shape)}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    counts = lengths.numpy()  # numpy's checks of a few hundred lengths: ~2 us, torch's ~15
    if (counts < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {counts.min()}")
    total = int(counts.sum())
    if total != num_tokens:
        raise ValueError(
            f"seq_lens sums to {total} but logprobs has {num_tokens} entries; "
            "seq_lens must list the lengths of the packed sequences"
        )
    return lengths.to(device)


LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
"""Input dtypes the kernels compute in float32 (float16's exp overflows above 11.09)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16 and bfloat16 inputs, the input's own dtype otherwise."""
    return torch.float32 if dtype in LOW_PRECISION_DTYPES else dtype


def _as_like(name: str, values: Tensor, logprobs: Tensor) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.shape != logprobs.shape:
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}; both must be flat over the same positions"
        )
    return values.detach().to(device=logprobs.device, dtype=logprobs.dtype)


def _first_index(flags: Tensor) -> int:
    """The index of the first True entry of a bool tensor that holds one."""
    return int(flags.nonzero()[0, 0])


def _check_binary(mask: Tensor, selected: Tensor) -> None:
    """ValueError at the first mask value other than 0 and 1 (NaN included)."""
    not_binary = selected & (mask != 1)
    if bool(not_binary.any()):
        index = _first_index(not_binary)
        raise ValueError(
            f"mask[{index}] is {mask[index].item()}, but a mask holds only 0 and 1 (or is a "
            "bool tensor); to weight positions, scale the advantages (weights) instead"
        )


def count_true(selected: Tensor) -> int:
    """How many entries of a bool tensor are True (numpy's count is ~5x torch's on CPU)."""
    if selected.device.type == "cpu":
        return int(np.count_nonzero(selected.numpy()))
    return int(selected.count_nonzero())


def _selection(mask: Tensor | None, logprobs: Tensor) -> tuple[Tensor | None, int]:
    """(the mask as bool, or None when it selects every position; the selected count)."""
    if mask is None:
        return None, logprobs.numel()
    mask_tensor = torch.as_tensor(mask, device=logprobs.device)
    if mask_tensor.shape != logprobs.shape:
        raise ValueError(
            f"mask has shape {tuple(mask_tensor.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}"
        )
    if mask_tensor.dtype == torch.bool:
        selected = mask_tensor
    else:
        selected = mask_tensor != 0
        _check_binary(mask_tensor, selected)
    count = count_true(selected)
    # An all-ones mask takes the unmasked path, so both give bit-identical results.
    return (None if count == logprobs.numel() else selected), count


class Inputs(NamedTuple):
    """A kernel call's inputs, validated: flat detached values and the selection.

    Values are in the compute dtype (float32 for low-precision logprobs) and not yet
    checked for finiteness: ``pack_finite`` does that for the eager kernel; a fused
    form's total is NaN where one is not finite.
    """

    logprobs: Tensor
    sampling_logprobs: Tensor | None
    advantages: Tensor  # the caller's values (not yet masked)
    selected: Tensor | None  # bool mask; None when every position trains
    count: int  # selected positions
    seq_lens: Tensor  # int64, on the data's device
    weight_name: str  # what the caller calls the advantages: "advantages" or "weights"


def validate(
    logprobs: Tensor,
    sampling_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None,
    seq_lens: SeqLens | None,
    weight_name: str,
) -> Inputs:
    """The call's tensors checked (types, shapes, dtypes, mask, seq_lens) into ``Inputs``."""
    if not isinstance(logprobs, Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    if logprobs.ndim != 1:
        raise ValueError(
            f"logprobs must be 1-D (flat packed batch), got shape {tuple(logprobs.shape)}"
        )
    if not logprobs.dtype.is_floating_point:
        raise ValueError(f"logprobs must be a floating tensor, got dtype {logprobs.dtype}")
    values = logprobs.detach().to(_compute_dtype(logprobs.dtype))
    advantages = _as_like(weight_name, advantages, values)
    old = (
        None
        if sampling_logprobs is None
        else _as_like("sampling_logprobs", sampling_logprobs, values)
    )
    selected, count = _selection(mask, values)
    lengths = _as_seq_lens(seq_lens, values.numel(), values.device)
    return Inputs(values, old, advantages, selected, count, lengths, weight_name)


def _named_values(inputs: Inputs) -> dict[str, Tensor]:
    """The value tensors a kernel reads, by the names the caller knows them under."""
    named = {"logprobs": inputs.logprobs}
    if inputs.sampling_logprobs is not None:
        named["sampling_logprobs"] = inputs.sampling_logprobs
    named[inputs.weight_name] = inputs.advantages
    return named


def nonfinite_error(inputs: Inputs) -> ValueError | None:
    """The error naming the first non-finite masked-in value (tensor and index), if any."""
    for name, values in _named_values(inputs).items():
        bad = ~torch.isfinite(values)
        if inputs.selected is not None:
            bad &= inputs.selected
        if bool(bad.any()):
            index = _first_index(bad)
            return ValueError(
                f"{name}[{index}] is {values[index].item()} at a masked-in position; every "
                "masked-in value must be finite (fix it upstream or mask the position out)"
            )
    return None


def pack(inputs: Inputs) -> Units:
    """The inputs as token units, with the log-ratio and the advantages masked."""
    values, old, advantages, selected, count, lengths, _ = inputs
    if selected is None:
        return Units(
            logprobs=values,
            log_ratio=None if old is None else values - old,
            advantages=advantages,
            selected=None,
            mask=None,
            seq_lens=lengths,
            unit_count=count,
            token_count=count,
        )
    weight = as_float(selected, torch.empty_like(values))
    log_ratio = None
    if old is not None:
        # lp·m − lp_old·m: exactly lp − lp_old where m = 1 and exactly 0 where m = 0, even
        # where lp − lp_old would overflow (r there would be inf, and inf·0 is NaN).
        log_ratio = torch.mul(values, weight).addcmul_(old, weight, value=-1)
    return Units(
        logprobs=values,
        log_ratio=log_ratio,
        advantages=advantages * weight,
        selected=selected,
        mask=weight,
        seq_lens=lengths,
        unit_count=count,
        token_count=count,
    )


def pack_finite(inputs: Inputs) -> Units:
    """``pack``, after rejecting a non-finite masked-in value (ValueError naming it) and
    replacing non-finite masked-out values by 0.

    One pass checks everything: Σ_t x_t·A_t with x the packed log-ratio (lp − lp_old, or lp
    without lp_old) is finite only if every x_t and A_t is (inf·0 is NaN, and a masked-out
    NaN survives the mask's multiply). Only a non-finite sum, which finite values
    overflowing it can also give, takes the exact check and the repacking.
    """
    tokens = pack(inputs)
    first = tokens.logprobs if tokens.log_ratio is None else tokens.log_ratio
    assert first is not None
    if bool(torch.dot(first, tokens.advantages).isfinite()):
        return tokens
    error = nonfinite_error(inputs)
    if error is not None:
        raise error
    cleaned = {
        name: torch.where(torch.isfinite(values), values, 0.0)
        for name, values in _named_values(inputs).items()
    }
    return pack(
        inputs._replace(
            logprobs=cleaned["logprobs"],
            sampling_logprobs=cleaned.get("sampling_logprobs"),
            advantages=cleaned[inputs.weight_name],
        )
    )
