"""The loss kernels' per-unit objectives (docs/FORMULAS.md), one function per formula.

Each objective takes the packed units of a batch (``grpo.core.packing.Units``: tokens, or
sequences for ``gspo``) and returns ``Terms``: the objective o per unit (0 on masked units),
its slope (do/dlp for token units, do/d(mean log-ratio) for sequence units) and its
statistics over the selected units: Σ r, min r, max r (when lp_old is given) and the clip
counts. ``grpo.core.loss_gradient`` turns the slope into the gradient; ``grpo.core.losses``
names each objective in the kernel registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from grpo.core.packing import Units, as_float, count_true
from grpo.core.reductions import Products

__all__ = [
    "Terms",
    "cispo_objective",
    "cross_entropy_objective",
    "dro_objective",
    "gspo_objective",
    "importance_sampling_objective",
    "ppo_objective",
]


class Terms(NamedTuple):
    """An objective's per-unit values, their slope and the statistics it reports.

    ``objective`` is o per unit, or a sum of scaled products Σ_k c_k·a_k·b_k: then Σ_u o_u
    is Σ_k c_k·(a_k · b_k), inner products that read their factors once and write
    nothing, and o itself is only formed when a reduction needs it per sequence.
    """

    objective: Tensor | Products
    slope: Tensor | Callable[[], Tensor]  # a callable is only run when a gradient is needed
    statistics: dict[str, Tensor | int]
    slope_is_scratch: bool = True  # False when slope is a caller's tensor: never written


def _log_ratio(units: Units) -> Tensor:
    # LossKernel.__call__ rejects a missing lp_old for every kernel that reads this.
    assert units.log_ratio is not None
    return units.log_ratio


def _logprobs(units: Units) -> Tensor:
    # Only sequence-level units drop lp, and the sequence-level objective never reads it.
    assert units.logprobs is not None
    return units.logprobs


def _ratio_statistics(ratio: Tensor, units: Units) -> dict[str, Tensor | int]:
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


def _unclipped_statistics(units: Units) -> dict[str, Tensor | int]:
    """Statistics of an objective without a clip: those of r when lp_old is given, else none.

    Call it last: r is computed in place of the log-ratio.
    """
    if units.log_ratio is None:
        return {}
    return _ratio_statistics(units.log_ratio.exp_(), units)


def _selected_count(outside: Tensor, units: Units, one_is_outside: bool) -> int:
    """How many selected units a ratio test marks, from the test over every unit.

    A masked unit holds r = 1 exactly, so the test marks it only when it marks 1, and the
    count over every unit then exceeds the selected count by exactly the masked units.
    """
    return count_true(outside) - (units.masked_out if one_is_outside else 0)


def _outside_counts(
    ratio: Tensor, units: Units, low: float, high: float
) -> tuple[Tensor, Tensor, int, int]:
    """(r < lo, r > hi) over every unit, and their counts over the selected units."""
    below, above = ratio < low, ratio > high
    below_count = _selected_count(below, units, low > 1)
    return below, above, below_count, _selected_count(above, units, high < 1)


def _clipped_surrogate(
    ratio: Tensor, units: Units, low: float, high: float, dual_clip: float | None
) -> Terms:
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
        clipped_count = count_true(clipped_side)
    else:
        clipped_count = count_true(clipped_side | negative.logical_and_(ratio > dual_clip))
        # c·min(A, 0) is c·A where A < 0; where A >= 0 it is 0 <= o (r, lo >= 0): a no-op.
        floor = advantages.clamp(max=0).mul_(dual_clip)
        clipped_side.logical_or_(floor > objective)
        torch.maximum(objective, floor, out=objective)
    statistics.update(
        clip_fraction=clipped_count, clip_low_fraction=below_count, clip_high_fraction=above_count
    )

    def slope() -> Tensor:
        # The statistics are taken, so r's buffer can hold the 0/1 keep-weights.
        return unclipped.mul_(as_float(clipped_side.logical_not_(), out=ratio))

    return Terms(objective=objective, slope=slope, statistics=statistics)


def importance_sampling_objective(units: Units) -> Terms:
    """Importance sampling: o_t = r·A, gradient d(−o_t)/d lp = −r·A."""
    ratio = _log_ratio(units).exp_()
    statistics = _ratio_statistics(ratio, units)
    objective = ratio.mul_(units.advantages)
    return Terms(objective=objective, slope=objective, statistics=statistics)


def ppo_objective(
    units: Units,
    *,
    clip_low_threshold: float,
    clip_high_threshold: float,
    dual_clip: float | None,
) -> Terms:
    """PPO: o_t = min(r·A, clip(r, lo, hi)·A); dual clip c: max(o_t, c·A) where A < 0."""
    ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(ratio, units, clip_low_threshold, clip_high_threshold, dual_clip)


def cispo_objective(
    units: Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> Terms:
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
    return Terms(objective=((1.0, weight, _logprobs(units)),), slope=weight, statistics=statistics)


def dro_objective(units: Units, *, beta: float) -> Terms:
    """DRO: o_t = lp·A − (β/2)·(lp − lp_old)², gradient −A + β·(lp − lp_old)."""
    log_ratio = _log_ratio(units)
    # Formed here, not as products: the statistics then turn the log-ratio into r in place.
    objective = torch.mul(_logprobs(units), units.advantages).addcmul_(
        log_ratio, log_ratio, value=-beta / 2
    )
    slope = torch.add(units.advantages, log_ratio, alpha=-beta)
    return Terms(objective=objective, slope=slope, statistics=_unclipped_statistics(units))


def gspo_objective(units: Units, *, clip_low_threshold: float, clip_high_threshold: float) -> Terms:
    """GSPO: s_i = exp(mean_{t∈i}(lp − lp_old)), o_i = min(s_i·A_i, clip(s_i, lo, hi)·A_i)."""
    sequence_ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(sequence_ratio, units, clip_low_threshold, clip_high_threshold, None)


def cross_entropy_objective(units: Units) -> Terms:
    """Cross entropy: o_t = w·lp with per-token weights w (passed as advantages)."""
    return Terms(
        objective=((1.0, units.advantages, _logprobs(units)),),
        slope=units.advantages,
        statistics=_unclipped_statistics(units),
        slope_is_scratch=False,
    )
