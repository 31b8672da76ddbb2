"""Vectorized policy-gradient loss kernels over a packed token batch (docs/FORMULAS.md).

Every kernel takes flat 1-D tensors over all target positions of a batch and returns
``(loss, metrics)``; the loss is the negative aggregated objective. Notation:
``r = exp(lp - lp_old)``, ``sg`` = stop-gradient, ``m`` = mask, ``A`` = advantage.

Supported losses (name: per-token objective o_t; config keys and defaults):

- ``importance_sampling``: ``r·A``; no config.
- ``ppo``: ``min(r·A, clip(r, lo, hi)·A)``, with dual clip ``c`` on ``A < 0`` tokens
  ``max(min(r·A, clip(r, lo, hi)·A), c·A)``; ``clip_low_threshold`` 0.8,
  ``clip_high_threshold`` 1.2, ``dual_clip`` None (off). DAPO clip-higher is ``ppo``
  with a larger ``clip_high_threshold`` (e.g. 1.28) and ``token_mean``.
- ``cispo``: ``sg(clip(r, lo, hi))·lp·A``; ``clip_low_threshold`` 0.0,
  ``clip_high_threshold`` 4.0.
- ``dro``: ``lp·A − (β/2)·(lp − lp_old)²``; ``beta`` 0.05.
- ``gspo`` (sequence level): ``s_i = exp(mean_{t∈i} (lp − lp_old))``, objective
  ``min(s_i·A_i, clip(s_i, lo, hi)·A_i)`` with ``A_i`` the mean advantage over the
  sequence's masked-in tokens (its one advantage, repeated); ``clip_low_threshold``
  1 − 3e-4, ``clip_high_threshold`` 1 + 4e-4.
- ``cross_entropy``: ``w·lp`` with per-token weights ``w`` in place of ``A``; no config.

Reductions (``REDUCTIONS``), with ``ℓ_t = −o_t·m_t``, ``n_i`` the masked-in token count of
sequence ``i`` and ``B`` the number of sequences with ``n_i > 0``: ``sum`` ``Σ_t ℓ_t``
(default), ``token_mean`` ``Σ_t ℓ_t / Σ_t m_t``, ``seq_mean_token_mean``
``(1/B) Σ_i Σ_{t∈i} ℓ_t / n_i``, ``seq_mean_token_sum`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t``,
``seq_mean_token_sum_norm`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t / L`` (``norm_length`` = L).
A sequence-level kernel treats each sequence as one unit carrying its loss ``ℓ_i``
(the token sum becomes ``ℓ_i`` and every ``n_i`` becomes 1): ``sum`` is ``Σ_i ℓ_i``,
``token_mean`` and both ``seq_mean_token_*`` are ``(1/B) Σ_i ℓ_i``, and
``seq_mean_token_sum_norm`` is ``(1/B) Σ_i ℓ_i / L``.

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

The loss is differentiable with respect to ``logprobs`` only (lp_old, A and the mask are
constants). Each kernel computes its gradient in closed form together with the loss
(the formulas' "gradients that follow"), on plain tensors and in place where it owns
them, and attaches it with a one-multiply backward; double backward is not supported.
At millions of tokens this is several times faster than letting autograd record every
elementwise step (``benchmarks/losses.py``).

The token-level policy kernels also have a single-pass form (``fused_losses``) that
``torch.compile`` turns into one vectorized loop: ``fused=None`` (the default) runs it on
CPU batches of at least ``FUSED_MIN_TOKENS`` positions, where it is several times faster
again; its first call compiles for a few seconds (once per process, dtype and variant).
``fused=True`` forces it, ``fused=False`` keeps the eager kernel; where torch.compile
fails the eager kernel runs, after one RuntimeWarning. ``gspo`` (sequence-level) and
``cross_entropy`` (two inner products: eager is as fast) have no fused form.

Metrics are over masked-in tokens (over sequences with ``n_i > 0`` for ``gspo``):
``loss``, ``train_tokens``, ``ratio_mean``/``ratio_min``/``ratio_max`` (0.0 when nothing
is selected), ``clip_fraction`` (share whose gradient the clip removed or reweighted),
``clip_low_fraction`` (r < lo), ``clip_high_fraction`` (r > hi); ``cispo`` adds
``clipped_ratio_mean``. ``cross_entropy`` without sampling log-probs reports only
``loss`` and ``train_tokens``.

KL to a reference policy (``δ = lp − lp_ref``): ``KL_ESTIMATORS`` k1 ``δ``, k2 ``δ²/2``,
k3 ``exp(−δ) + δ − 1``; ``kl_penalty`` gives the elementwise term.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import attrs
import numpy as np
import torch
from torch import Tensor

from grpo.core import fused_losses
from grpo.core.fused_losses import FusedTerms

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    SeqLens: TypeAlias = Tensor | Sequence[int] | ArrayLike

__all__ = [
    "KL_ESTIMATORS",
    "LOSSES",
    "FUSED_MIN_TOKENS",
    "REDUCTIONS",
    "LossKernel",
    "cispo",
    "cross_entropy",
    "dro",
    "get_loss",
    "gspo",
    "importance_sampling",
    "kl_penalty",
    "ppo",
    "resolve_config",
    "validate_reduction",
]

REDUCTIONS: tuple[str, ...] = (
    "sum",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

LossConfig: TypeAlias = dict[str, float | None]


def validate_reduction(reduction: str, norm_length: float | None) -> None:
    """Raise ValueError unless ``reduction`` is in REDUCTIONS and ``norm_length`` fits it."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    if reduction == "seq_mean_token_sum_norm":
        if norm_length is None:
            raise ValueError(
                "reduction 'seq_mean_token_sum_norm' needs norm_length (the constant L, "
                "e.g. the maximum completion length); pass norm_length=..."
            )
        if isinstance(norm_length, bool) or not isinstance(norm_length, (int, float)):
            raise ValueError(f"norm_length must be a number, got {norm_length!r}")
        if not (math.isfinite(norm_length) and norm_length > 0):
            raise ValueError(f"norm_length must be a finite number > 0, got {norm_length!r}")
    elif norm_length is not None:
        raise ValueError(
            f"norm_length={norm_length!r} is only used by reduction "
            f"'seq_mean_token_sum_norm', not {reduction!r}; drop it or change the reduction"
        )


# --- packed inputs ---------------------------------------------------------------------
# At a million tokens every float temporary costs a pass over memory and, when the
# allocator hands back fresh pages, a page fault per 4 KiB: the kernels work in place on
# the temporaries they own and compute gradients in closed form, without autograd's
# saved intermediates.


class _Units(NamedTuple):
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
        return _segment_sum(self.mask, self.seq_lens)

    def per_sequence(self) -> _Units:
        """One unit per sequence: masked mean log-ratio and masked mean advantage A_i."""
        tokens_per_sequence = self.counts_per_sequence()
        denominator = tokens_per_sequence.clamp(min=1)
        has_tokens = tokens_per_sequence > 0
        num_trained = int(has_tokens.count_nonzero())
        all_trained = num_trained == has_tokens.numel()
        return _Units(
            logprobs=None,
            log_ratio=_segment_sum(_log_ratio(self), self.seq_lens) / denominator,
            advantages=_segment_sum(self.advantages, self.seq_lens) / denominator,
            selected=None if all_trained else has_tokens,
            mask=None if all_trained else has_tokens.to(self.advantages.dtype),
            seq_lens=torch.ones_like(self.seq_lens),
            unit_count=num_trained,
            token_count=self.token_count,
            tokens_per_unit=denominator,
        )


def _segment_sum(values_N: Tensor, seq_lens_B: Tensor) -> Tensor:
    """Σ of values over each consecutive segment (no Python loop)."""
    return torch.segment_reduce(values_N, "sum", lengths=seq_lens_B)


def _as_float(selected: Tensor, out: Tensor) -> Tensor:
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
    if bool((lengths < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lengths.min().item()}")
    total = int(lengths.sum())
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


def _count_true(selected: Tensor) -> int:
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
    count = _count_true(selected)
    # An all-ones mask takes the unmasked path, so both give bit-identical results.
    return (None if count == logprobs.numel() else selected), count


class _Inputs(NamedTuple):
    """A kernel call's inputs, validated: flat detached values and the selection.

    Values are in the compute dtype (float32 for low-precision logprobs) and not yet
    checked for finiteness: ``_pack_finite`` does that for the eager kernel; a fused
    form's total is NaN where one is not finite.
    """

    logprobs: Tensor
    sampling_logprobs: Tensor | None
    advantages: Tensor  # the caller's values (not yet masked)
    selected: Tensor | None  # bool mask; None when every position trains
    count: int  # selected positions
    seq_lens: Tensor  # int64, on the data's device
    weight_name: str  # what the caller calls the advantages: "advantages" or "weights"


def _validate(
    logprobs: Tensor,
    sampling_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None,
    seq_lens: SeqLens | None,
    weight_name: str,
) -> _Inputs:
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
    return _Inputs(values, old, advantages, selected, count, lengths, weight_name)


def _named_values(inputs: _Inputs) -> dict[str, Tensor]:
    """The value tensors a kernel reads, by the names the caller knows them under."""
    named = {"logprobs": inputs.logprobs}
    if inputs.sampling_logprobs is not None:
        named["sampling_logprobs"] = inputs.sampling_logprobs
    named[inputs.weight_name] = inputs.advantages
    return named


def _nonfinite_error(inputs: _Inputs) -> ValueError | None:
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


def _pack(inputs: _Inputs) -> _Units:
    """The inputs as token units, with the log-ratio and the advantages masked."""
    values, old, advantages, selected, count, lengths, _ = inputs
    if selected is None:
        return _Units(
            logprobs=values,
            log_ratio=None if old is None else values - old,
            advantages=advantages,
            selected=None,
            mask=None,
            seq_lens=lengths,
            unit_count=count,
            token_count=count,
        )
    weight = _as_float(selected, torch.empty_like(values))
    log_ratio = None
    if old is not None:
        # lp·m − lp_old·m: exactly lp − lp_old where m = 1 and exactly 0 where m = 0, even
        # where lp − lp_old would overflow (r there would be inf, and inf·0 is NaN).
        log_ratio = torch.mul(values, weight).addcmul_(old, weight, value=-1)
    return _Units(
        logprobs=values,
        log_ratio=log_ratio,
        advantages=advantages * weight,
        selected=selected,
        mask=weight,
        seq_lens=lengths,
        unit_count=count,
        token_count=count,
    )


def _pack_finite(inputs: _Inputs) -> _Units:
    """``_pack``, after rejecting a non-finite masked-in value (ValueError naming it) and
    replacing non-finite masked-out values by 0.

    One pass checks everything: Σ_t x_t·A_t with x the packed log-ratio (lp − lp_old, or lp
    without lp_old) is finite only if every x_t and A_t is (inf·0 is NaN, and a masked-out
    NaN survives the mask's multiply). Only a non-finite sum, which finite values
    overflowing it can also give, takes the exact check and the repacking.
    """
    tokens = _pack(inputs)
    first = tokens.logprobs if tokens.log_ratio is None else tokens.log_ratio
    assert first is not None
    if bool(torch.dot(first, tokens.advantages).isfinite()):
        return tokens
    error = _nonfinite_error(inputs)
    if error is not None:
        raise error
    cleaned = {
        name: torch.where(torch.isfinite(values), values, 0.0)
        for name, values in _named_values(inputs).items()
    }
    return _pack(
        inputs._replace(
            logprobs=cleaned["logprobs"],
            sampling_logprobs=cleaned.get("sampling_logprobs"),
            advantages=cleaned[inputs.weight_name],
        )
    )


# --- per-unit objectives ---------------------------------------------------------------
# Each returns the objective o per unit (0 on masked units), its slope (do/dlp for token
# units, do/d(mean log-ratio) for sequence units) and its statistics over the selected
# units: Σ r, min r, max r (when lp_old is given) and the clip counts. The kernel turns
# the slope into the gradient.


_Products: TypeAlias = tuple[tuple[float, Tensor, Tensor], ...]


class _Terms(NamedTuple):
    """An objective's per-unit values, their slope and the statistics it reports.

    ``objective`` is o per unit, or a sum of scaled products Σ_k c_k·a_k·b_k: then Σ_u o_u
    is Σ_k c_k·(a_k · b_k), inner products that read their factors once and write
    nothing, and o itself is only formed when a reduction needs it per sequence.
    """

    objective: Tensor | _Products
    slope: Tensor | Callable[[], Tensor]  # a callable is only run when a gradient is needed
    statistics: dict[str, Tensor | int]
    slope_is_scratch: bool = True  # False when slope is a caller's tensor: never written


def _objective_values(objective: Tensor | _Products) -> Tensor:
    """o per unit."""
    if isinstance(objective, Tensor):
        return objective
    values = torch.zeros_like(objective[0][1])
    for scale, first, second in objective:
        values.addcmul_(first, second, value=scale)
    return values


def _objective_sum(objective: Tensor | _Products) -> Tensor:
    """Σ_u o_u."""
    if isinstance(objective, Tensor):
        return objective.sum()
    totals = [torch.dot(first, second) * scale for scale, first, second in objective]
    return torch.stack(totals).sum()


def _log_ratio(units: _Units) -> Tensor:
    # LossKernel.__call__ rejects a missing lp_old for every kernel that reads this.
    assert units.log_ratio is not None
    return units.log_ratio


def _logprobs(units: _Units) -> Tensor:
    # Only sequence-level units drop lp, and the sequence-level objective never reads it.
    assert units.logprobs is not None
    return units.logprobs


def _ratio_statistics(ratio: Tensor, units: _Units) -> dict[str, Tensor | int]:
    """Σ r, min r and max r over the selected units (0 when none is), and zero clip counts."""
    no_clips = {"clip_fraction": 0, "clip_low_fraction": 0, "clip_high_fraction": 0}
    if units.unit_count == 0:
        return {"ratio_mean": 0, "ratio_min": 0, "ratio_max": 0, **no_clips}
    low, high = torch.aminmax(ratio)
    if units.mask is None:
        return {"ratio_mean": ratio.sum(), "ratio_min": low, "ratio_max": high, **no_clips}
    # A masked unit holds r = 1 exactly, so a global extreme other than 1 is a selected
    # unit's; so is 1 when both extremes are 1. Only one extreme at exactly 1 is ambiguous.
    if bool((low == 1.0) ^ (high == 1.0)):
        assert units.selected is not None
        low = torch.where(units.selected, ratio, math.inf).min()
        high = torch.where(units.selected, ratio, 0.0).max()
    ratio_sum = torch.dot(ratio, units.mask)
    return {"ratio_mean": ratio_sum, "ratio_min": low, "ratio_max": high, **no_clips}


def _unclipped_statistics(units: _Units) -> dict[str, Tensor | int]:
    """Statistics of an objective without a clip: those of r when lp_old is given, else none.

    Call it last: r is computed in place of the log-ratio.
    """
    if units.log_ratio is None:
        return {}
    return _ratio_statistics(units.log_ratio.exp_(), units)


def _selected_count(outside: Tensor, units: _Units, one_is_outside: bool) -> int:
    """How many selected units a ratio test marks, from the test over every unit.

    A masked unit holds r = 1 exactly, so the test marks it only when it marks 1, and the
    count over every unit then exceeds the selected count by exactly the masked units.
    """
    return _count_true(outside) - (units.masked_out if one_is_outside else 0)


def _outside_counts(
    ratio: Tensor, units: _Units, low: float, high: float
) -> tuple[Tensor, Tensor, int, int]:
    """(r < lo, r > hi) over every unit, and their counts over the selected units."""
    below, above = ratio < low, ratio > high
    below_count = _selected_count(below, units, low > 1)
    return below, above, below_count, _selected_count(above, units, high < 1)


def _clipped_surrogate(
    ratio: Tensor, units: _Units, low: float, high: float, dual_clip: float | None
) -> _Terms:
    """min(r·A, clip(r, lo, hi)·A), dual-clipped to max(·, c·A) where A < 0; r is overwritten.

    do/dr is A, except 0 on the clipped side (r > hi with A > 0, r < lo with A < 0) and
    where the dual clip is active; do/dlp = r·do/dr.
    """
    advantages = units.advantages
    statistics = _ratio_statistics(ratio, units)
    below, above, below_count, above_count = _outside_counts(ratio, units, low, high)
    unclipped = ratio * advantages
    objective = ratio.clamp(low, high).mul_(advantages)
    torch.minimum(unclipped, objective, out=objective)
    # Masked units hold A = 0, so the sign tests exclude them without the mask.
    negative = advantages < 0
    clipped_side = (advantages > 0).logical_and_(above).logical_or_(below.logical_and_(negative))
    if dual_clip is None:
        clipped_count = _count_true(clipped_side)
    else:
        clipped_count = _count_true(clipped_side | negative.logical_and_(ratio > dual_clip))
        # c·min(A, 0) is c·A where A < 0; where A >= 0 it is 0 <= o (r, lo >= 0): a no-op.
        floor = advantages.clamp(max=0).mul_(dual_clip)
        clipped_side.logical_or_(floor > objective)
        torch.maximum(objective, floor, out=objective)
    statistics.update(
        clip_fraction=clipped_count, clip_low_fraction=below_count, clip_high_fraction=above_count
    )

    def slope() -> Tensor:
        # The statistics are taken, so r's buffer can hold the 0/1 keep-weights.
        return unclipped.mul_(_as_float(clipped_side.logical_not_(), out=ratio))

    return _Terms(objective=objective, slope=slope, statistics=statistics)


def _importance_sampling_objective(units: _Units) -> _Terms:
    """Importance sampling: o_t = r·A, gradient d(−o_t)/d lp = −r·A."""
    ratio = _log_ratio(units).exp_()
    statistics = _ratio_statistics(ratio, units)
    objective = ratio.mul_(units.advantages)
    return _Terms(objective=objective, slope=objective, statistics=statistics)


def _ppo_objective(
    units: _Units,
    *,
    clip_low_threshold: float,
    clip_high_threshold: float,
    dual_clip: float | None,
) -> _Terms:
    """PPO: o_t = min(r·A, clip(r, lo, hi)·A); dual clip c: max(o_t, c·A) where A < 0."""
    ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(ratio, units, clip_low_threshold, clip_high_threshold, dual_clip)


def _cispo_objective(
    units: _Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> _Terms:
    """CISPO: o_t = sg(clip(r, lo, hi))·lp·A, gradient −clip(r, lo, hi)·A everywhere."""
    ratio = _log_ratio(units).exp_()
    statistics = _ratio_statistics(ratio, units)
    # r >= 0 is never below a bound of 0 (the default): skip that pass.
    below_count = (
        _selected_count(ratio < clip_low_threshold, units, clip_low_threshold > 1)
        if clip_low_threshold > 0
        else 0
    )
    above_count = _selected_count(ratio > clip_high_threshold, units, clip_high_threshold < 1)
    clipped_ratio = ratio.clamp_(clip_low_threshold, clip_high_threshold)
    statistics.update(
        # lo <= hi, so no ratio is both below and above: the counts add up.
        clip_fraction=below_count + above_count,
        clip_low_fraction=below_count,
        clip_high_fraction=above_count,
        clipped_ratio_mean=(
            clipped_ratio.sum() if units.mask is None else torch.dot(clipped_ratio, units.mask)
        ),
    )
    weight = clipped_ratio.mul_(units.advantages)
    return _Terms(objective=((1.0, weight, _logprobs(units)),), slope=weight, statistics=statistics)


def _dro_objective(units: _Units, *, beta: float) -> _Terms:
    """DRO: o_t = lp·A − (β/2)·(lp − lp_old)², gradient −A + β·(lp − lp_old)."""
    log_ratio = _log_ratio(units)
    # Formed here, not as products: the statistics then turn the log-ratio into r in place.
    objective = torch.mul(_logprobs(units), units.advantages).addcmul_(
        log_ratio, log_ratio, value=-beta / 2
    )
    slope = torch.add(units.advantages, log_ratio, alpha=-beta)
    return _Terms(objective=objective, slope=slope, statistics=_unclipped_statistics(units))


def _gspo_objective(
    units: _Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> _Terms:
    """GSPO: s_i = exp(mean_{t∈i}(lp − lp_old)), o_i = min(s_i·A_i, clip(s_i, lo, hi)·A_i)."""
    sequence_ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(sequence_ratio, units, clip_low_threshold, clip_high_threshold, None)


def _cross_entropy_objective(units: _Units) -> _Terms:
    """Cross entropy: o_t = w·lp with per-token weights w (passed as advantages)."""
    return _Terms(
        objective=((1.0, units.advantages, _logprobs(units)),),
        slope=units.advantages,
        statistics=_unclipped_statistics(units),
        slope_is_scratch=False,
    )


# --- aggregation and the gradient ------------------------------------------------------


def _reduction_derivative(
    reduction: str,
    norm_length: float | None,
    unit_count: int,
    units_per_sequence: Callable[[], Tensor],
    seq_lens: Tensor,
) -> float | Tensor:
    """d(aggregate)/d o_u under ``reduction``: aggregate = Σ_u d_u·o_u (docs/FORMULAS.md).

    One number, or one per unit for ``seq_mean_token_mean`` (1/(B·n_i) on sequence i).
    ``units_per_sequence`` gives n_i as floats; it is only called by the ``seq_mean_*``
    reductions.
    """
    if reduction == "sum":
        return 1.0
    if reduction == "token_mean":
        return 1.0 / max(unit_count, 1)
    counts = units_per_sequence()
    num_sequences = max(int(counts.count_nonzero()), 1)
    if reduction == "seq_mean_token_mean":
        inverse_counts = counts.clamp(min=1).reciprocal_().div_(num_sequences)
        return torch.repeat_interleave(inverse_counts, seq_lens, output_size=int(seq_lens.sum()))
    if reduction == "seq_mean_token_sum":
        return 1.0 / num_sequences
    assert norm_length is not None  # validate_reduction guarantees it for this reduction
    return 1.0 / num_sequences / norm_length


def _aggregate(
    objective: Tensor | _Products, units: _Units, reduction: str, norm_length: float | None
) -> tuple[Tensor, float | Tensor]:
    """(Σ_u d_u·o_u, the derivative d): the aggregate under ``reduction``, 0 if none selected."""
    derivative = _reduction_derivative(
        reduction, norm_length, units.unit_count, units.counts_per_sequence, units.seq_lens
    )
    if isinstance(derivative, float):
        return _objective_sum(objective) * derivative, derivative
    return torch.dot(_objective_values(objective), derivative), derivative


def _loss_gradient(
    terms: _Terms, derivative: float | Tensor, tokens: _Units, units: _Units
) -> Tensor:
    """d loss/d lp per token: −(dΣ/do)·slope, spread over the tokens of sequence units.

    For a sequence unit, d(mean_{t∈i} log-ratio)/d lp_t = m_t / n_i.
    """
    slope = terms.slope() if callable(terms.slope) else terms.slope
    if isinstance(derivative, float):
        gradient = slope.mul_(-derivative) if terms.slope_is_scratch else slope * -derivative
    else:
        gradient = (slope.mul_(derivative) if terms.slope_is_scratch else slope * derivative).neg_()
    if units.tokens_per_unit is None:
        return gradient
    per_token = torch.repeat_interleave(
        gradient.div_(units.tokens_per_unit),
        tokens.seq_lens,
        output_size=tokens.advantages.numel(),
    )
    return per_token if tokens.mask is None else per_token.mul_(tokens.mask)


class _KnownGradient(torch.autograd.Function):
    """A loss whose gradient w.r.t. logprobs is already computed: backward is one multiply."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, logprobs: Tensor, loss: Tensor, gradient: Tensor
    ) -> Tensor:
        # Held as an attribute, not saved: backward hands it over as the only reference,
        # so autograd makes it the leaf's .grad instead of copying it (32 MiB at 8M tokens).
        ctx.gradient = gradient  # type: ignore[attr-defined]
        return loss.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor
    ) -> tuple[Tensor, None, None]:
        gradient = ctx.__dict__.pop("gradient", None)
        if gradient is None:
            raise RuntimeError(
                "this loss's gradient was already handed to an earlier backward; call the "
                "kernel again instead of backward(retain_graph=True) a second time"
            )
        if gradient.device.type == "cpu" and bool(grad_loss == 1):
            return gradient, None, None  # loss.backward() seeds 1
        return gradient.mul_(grad_loss), None, None


# --- the compiled single-pass path -----------------------------------------------------

FUSED_MIN_TOKENS = 1 << 18
"""Positions (256 sequences of 1024) from which ``fused=None`` runs the compiled form on CPU.

From here the compiled form is faster than the eager kernel (``benchmarks/losses.py``).
Its first call in a process compiles for a few seconds (per kernel, dtype and variant):
noise in a training run, but not worth it for the small calls of tests and notebooks.
"""

# Forms whose compilation failed in this process: they run eagerly from then on. A cache
# like torch's own compile cache (results never depend on it, only speed).
_UNCOMPILABLE_FORMS: set[Callable[..., FusedTerms]] = set()


@functools.cache
def _compiled_form(form: Callable[..., FusedTerms]) -> Callable[..., FusedTerms]:
    """``form`` under torch.compile, with symbolic sizes: one compilation serves every N."""
    return torch.compile(form, dynamic=True)


def _run_fused(
    form: Callable[..., FusedTerms],
    inputs: _Inputs,
    logprobs: Tensor,
    reduction: str,
    norm_length: float | None,
    config: LossConfig,
) -> tuple[Tensor, dict[str, float]] | None:
    """The kernel through its compiled single-pass form; None if it does not compile here."""
    if form in _UNCOMPILABLE_FORMS:
        return None
    values, old, advantages, selected, count, lengths, _ = inputs
    num_positions = values.numel()
    if selected is None:
        # One graph for masked and unmasked batches: an all-true mask costs a byte a token.
        selected = torch.ones(num_positions, dtype=torch.bool, device=values.device)
    derivative = _reduction_derivative(
        reduction,
        norm_length,
        count,
        lambda: _segment_sum(_as_float(selected, torch.empty_like(values)), lengths),
        lengths,
    )
    like = {"dtype": values.dtype, "device": values.device}
    # 0-d tensors, not floats: a new threshold or batch size then needs no recompilation.
    config_tensors = {
        key: torch.tensor(math.inf if value is None else value, **like)
        for key, value in config.items()
    }
    want_gradient = logprobs.requires_grad and torch.is_grad_enabled()
    try:
        with torch.no_grad():
            terms = _compiled_form(form)(
                values,
                old,
                advantages,
                selected,
                torch.as_tensor(derivative, **like),
                want_gradient,
                **config_tensors,
            )
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
        _UNCOMPILABLE_FORMS.add(form)
        reason = (str(error).strip().splitlines() or [""])[0][:300]  # compiler logs run long
        warnings.warn(
            f"torch.compile could not build the fused {form.__name__} here "
            f"({type(error).__name__}: {reason}); using the eager kernel from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    if not bool(terms.total.isfinite()):  # a non-finite input, or a sum that overflowed
        error = _nonfinite_error(inputs)
        if error is not None:
            raise error
    loss = terms.total.neg()
    if want_gradient:
        assert terms.gradient is not None
        loss = _KnownGradient.apply(logprobs, loss, terms.gradient.to(logprobs.dtype))
    return loss, _metrics(loss, count, count, terms.statistics, values.device)


# --- the registry ----------------------------------------------------------------------


def _freeze_defaults(defaults: Mapping[str, float | None]) -> Mapping[str, float | None]:
    return MappingProxyType(dict(defaults))


@attrs.frozen(slots=False)
class LossKernel:
    """A named loss: its config defaults and its objective (with slope and clip counts).

    Calling it runs the whole kernel:
    ``loss, metrics = kernel(logprobs, sampling_logprobs, advantages, *, mask=None,
    seq_lens=None, reduction="sum", norm_length=None, fused=None, **config)``.
    """

    name: str
    defaults: Mapping[str, float | None] = attrs.field(converter=_freeze_defaults)
    sequence_level: bool
    objective: Callable[..., _Terms] = attrs.field(repr=False)
    weight_input: str = "advantages"
    """The datum ``loss_fn_inputs`` key holding the per-token weight (A, or w for CE)."""
    needs_sampling_logprobs: bool = True
    """Whether the objective uses lp_old (cross_entropy only reports ratios when given it)."""
    fused_form: Callable[..., FusedTerms] | None = attrs.field(default=None, repr=False)
    """The single-pass form for torch.compile (``fused_losses``), None if there is none."""
    service_builtin: bool = True
    """Whether PyTRIO's ``forward_backward`` has this loss built in (else: as a custom loss)."""

    def __attrs_post_init__(self) -> None:
        # The instance's docstring is its formula, so help(losses.ppo) states the math.
        object.__setattr__(self, "__doc__", self.objective.__doc__)

    def resolve(self, config: Mapping[str, object]) -> LossConfig:
        """Defaults merged with ``config``, validated (unknown keys and bad thresholds raise)."""
        unknown = sorted(set(config) - set(self.defaults))
        if unknown:
            valid = (
                ", ".join(sorted(self.defaults)) if self.defaults else "none (it takes no config)"
            )
            raise ValueError(
                f"unknown config key {unknown[0]!r} for loss {self.name!r}; valid keys: {valid}"
            )
        resolved: LossConfig = {}
        for key, default in self.defaults.items():
            value = config.get(key, default)
            if value is None and default is None:
                resolved[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number for loss {self.name!r}, got {value!r}")
            if math.isnan(value):
                raise ValueError(f"{key} must be a number for loss {self.name!r}, got nan")
            resolved[key] = float(value)
        _validate_thresholds(self.name, resolved)
        return resolved

    def __call__(
        self,
        logprobs: Tensor,
        sampling_logprobs: Tensor | None,
        advantages: Tensor,
        *,
        mask: Tensor | None = None,
        seq_lens: SeqLens | None = None,
        reduction: str = "sum",
        norm_length: float | None = None,
        fused: bool | None = None,
        **config: float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss −aggregate(o) under ``reduction`` and float metrics over masked-in units.

        The loss is differentiable w.r.t. ``logprobs`` only (lp_old, A and the mask are
        constants); its gradient is computed here, in closed form, with the loss.
        ``fused``: None runs the compiled single-pass form on CPU batches of at least
        ``FUSED_MIN_TOKENS`` positions (where it wins), True runs it at any size and
        device, False never; the eager kernel runs otherwise, and whenever the batch
        selects nothing or torch.compile fails here (with a warning). A non-finite
        masked-in value or a non-binary mask raises ValueError naming the tensor and index.
        """
        resolved = self.resolve(config)
        validate_reduction(reduction, norm_length)
        if sampling_logprobs is None and self.needs_sampling_logprobs:
            raise ValueError(
                f"loss {self.name!r} needs sampling_logprobs (the sampler's log-probs), got None"
            )
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (auto), True or False, got {fused!r}")
        inputs = _validate(
            logprobs, sampling_logprobs, advantages, mask, seq_lens, self.weight_input
        )
        form = self._fused_form_for(inputs, fused)
        if form is not None:
            result = _run_fused(form, inputs, logprobs, reduction, norm_length, resolved)
            if result is not None:
                return result
        tokens = _pack_finite(inputs)
        units = tokens.per_sequence() if self.sequence_level else tokens
        terms = self.objective(units, **resolved)
        total, derivative = _aggregate(terms.objective, units, reduction, norm_length)
        loss = total.neg_()
        if logprobs.requires_grad and torch.is_grad_enabled():
            gradient = _loss_gradient(terms, derivative, tokens, units)
            # Autograd would cast a float32 gradient too, but only at backward: casting now
            # holds half the memory until then and hands over the tensor without a copy.
            loss = _KnownGradient.apply(logprobs, loss, gradient.to(logprobs.dtype))
        device = logprobs.device
        return loss, _metrics(loss, units.unit_count, units.token_count, terms.statistics, device)

    def _fused_form_for(
        self, inputs: _Inputs, fused: bool | None
    ) -> Callable[..., FusedTerms] | None:
        """The fused form this call should run, or None for the eager kernel."""
        if fused is False:
            return None
        form = self.fused_form
        if form is None:
            if fused:
                raise ValueError(
                    f"loss {self.name!r} has no fused form (fused forms: "
                    f"{', '.join(name for name, k in LOSSES.items() if k.fused_form)}); "
                    "pass fused=None or fused=False"
                )
            return None
        # Nothing selected, or a single position: the eager kernel's special cases.
        if inputs.count == 0 or inputs.logprobs.numel() < 2:
            return None
        if fused is None and (
            inputs.logprobs.device.type != "cpu" or inputs.logprobs.numel() < FUSED_MIN_TOKENS
        ):
            return None
        return form


def _validate_thresholds(name: str, config: LossConfig) -> None:
    for key in ("clip_low_threshold", "clip_high_threshold", "beta"):
        value = config.get(key)
        if value is not None and value < 0:
            raise ValueError(f"{key} must be >= 0 for loss {name!r}, got {value}")
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"clip_low_threshold ({low}) must not exceed clip_high_threshold ({high}) "
            f"for loss {name!r}; they are absolute ratio bounds, e.g. 0.8 and 1.2"
        )
    beta = config.get("beta")
    if beta is not None and not math.isfinite(beta):
        raise ValueError(f"beta must be finite for loss {name!r}, got {beta}")
    dual_clip = config.get("dual_clip")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(
            f"dual_clip must be > 1 for loss {name!r}, got {dual_clip}; "
            "use e.g. 3.0, or None to turn it off"
        )


@torch.no_grad()
def _metrics(
    loss: Tensor,
    unit_count: int,
    token_count: int,
    statistics: Mapping[str, Tensor | int],
    device: torch.device,
) -> dict[str, float]:
    """Loss, token count, ratio statistics and clip shares over the selected units."""
    metrics = {"loss": float(loss), "train_tokens": float(token_count)}
    if not statistics:
        return metrics
    per_unit = float(max(unit_count, 1))
    names = list(statistics)
    # One transfer for all statistics: a device sync each would cost more than the loss.
    totals = torch.stack(
        [
            torch.as_tensor(value, dtype=torch.float64, device=device)
            for value in statistics.values()
        ]
    ).tolist()
    for name, total in zip(names, totals, strict=True):
        # Extremes are values; every other statistic is a sum over the selected units.
        metrics[name] = total if name in ("ratio_min", "ratio_max") else total / per_unit
    return metrics


importance_sampling = LossKernel(
    name="importance_sampling",
    defaults={},
    sequence_level=False,
    objective=_importance_sampling_objective,
    fused_form=fused_losses.fused_importance_sampling,
)
ppo = LossKernel(
    name="ppo",
    defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "dual_clip": None},
    sequence_level=False,
    objective=_ppo_objective,
    fused_form=fused_losses.fused_ppo,
)
cispo = LossKernel(
    name="cispo",
    defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    sequence_level=False,
    objective=_cispo_objective,
    fused_form=fused_losses.fused_cispo,
)
dro = LossKernel(
    name="dro",
    defaults={"beta": 0.05},
    sequence_level=False,
    objective=_dro_objective,
    fused_form=fused_losses.fused_dro,
)
gspo = LossKernel(
    name="gspo",
    defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    sequence_level=True,
    objective=_gspo_objective,
    service_builtin=False,
)
cross_entropy = LossKernel(
    name="cross_entropy",
    defaults={},
    sequence_level=False,
    objective=_cross_entropy_objective,
    weight_input="weights",
    needs_sampling_logprobs=False,
)

LOSSES: Mapping[str, LossKernel] = MappingProxyType(
    {kernel.name: kernel for kernel in (importance_sampling, ppo, cispo, dro, gspo, cross_entropy)}
)


def get_loss(name: str) -> LossKernel:
    """The registered kernel called ``name``; ValueError listing the known names otherwise."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}"
        ) from None


def resolve_config(name: str, config: Mapping[str, object]) -> LossConfig:
    """Kernel ``name``'s defaults merged with ``config`` after validating keys and thresholds."""
    return get_loss(name).resolve(config)


# --- KL to a reference policy ------------------------------------------------------------


def _kl_k1(delta: Tensor) -> Tensor:
    """k1 = δ (unbiased, high variance, can be negative)."""
    return delta


def _kl_k2(delta: Tensor) -> Tensor:
    """k2 = δ²/2."""
    return delta.square() / 2


def _kl_k3(delta: Tensor) -> Tensor:
    """k3 = exp(−δ) + δ − 1 (≥ 0, low variance); expm1 keeps it exact near δ = 0."""
    return torch.expm1(-delta) + delta


KL_ESTIMATORS: Mapping[str, Callable[[Tensor], Tensor]] = MappingProxyType(
    {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}
)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str = "k3") -> Tensor:
    """Elementwise KL estimate k(δ) with δ = lp − lp_ref.

    Used as a penalty term ``kl_coef · Σ_t m_t·k_t`` or, as ``grpo train`` does, as reward
    shaping of the advantages (docs/FORMULAS.md, KL).
    """
    try:
        estimate = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}"
        ) from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}"
        )
    return estimate(logprobs - ref_logprobs)
