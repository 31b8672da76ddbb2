"""Single-pass forms of the token-level policy loss kernels, written for ``torch.compile``.

Each function computes, from validated inputs, everything its kernel in
``grpo.core.losses`` reports: ``Σ_t d_t·o_t`` (the aggregate, with ``d`` the reduction's
derivative w.r.t. each token's objective, one number or one per token), the gradient
``−d_t·∂o_t/∂lp_t`` and the statistics over the selected tokens. The body is only
elementwise ops and full reductions, so inductor turns it into one vectorized loop that
reads each input once and writes the gradient once; run eagerly, the same function is a
plain (slow, many-temporaries) statement of the math, which is how the tests check it.

Inputs: ``logprobs``, ``sampling_logprobs``, ``advantages`` are flat float tensors,
``mask`` a bool tensor of the same length (masked positions contribute nothing, whatever
values they hold, NaN included), ``derivative`` a 0-d or flat tensor, config values
0-d tensors (tensors, not floats, so that a new threshold does not recompile).
``dual_clip`` = +inf means no dual clip. Statistics are sums, counts and extremes; the
caller divides by the selected count.

A non-finite input at a selected position makes the total NaN: the total adds
``0·(lp − lp_old + A)``, which is 0 where all three are finite and NaN where one is not.
The check costs an add and a multiply a position and no reduction of its own (a separate
count, one accumulator more in the loop, made the compiled CISPO 50% slower); the caller
looks for the culprit when the total is not finite.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "FusedTerms",
    "fused_cispo",
    "fused_dro",
    "fused_importance_sampling",
    "fused_ppo",
]


class FusedTerms(NamedTuple):
    """Σ d·o, the gradient −d·∂o/∂lp (None when not asked for) and the statistics."""

    total: Tensor
    gradient: Tensor | None
    statistics: dict[str, Tensor]


def _ratio(logprobs: Tensor, sampling_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """(lp − lp_old, r = exp(lp − lp_old)) at every position.

    Not masked first: every output selects with the mask at the end, so whatever r is on
    a masked position (inf, NaN) never reaches the loss, the gradient or a statistic; and
    a select feeding exp makes inductor's loop ~2x slower here than exp of a difference.
    """
    log_ratio = logprobs - sampling_logprobs
    return log_ratio, torch.exp(log_ratio)


def _ratio_statistics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Σ r, min r and max r over the selected positions."""
    return {
        "ratio_mean": torch.where(mask, ratio, 0.0).sum(),
        "ratio_min": torch.where(mask, ratio, torch.inf).amin(),
        "ratio_max": torch.where(mask, ratio, -torch.inf).amax(),
    }


def _count(selected: Tensor) -> Tensor:
    """How many entries are True, as an int32 sum: one 16-lane accumulator in the compiled
    loop where an int64 count takes two and a widening per vector (the caller runs the
    eager kernel on batches of 2**31 positions and more, which would overflow it)."""
    return selected.sum(dtype=torch.int32)


def _no_clips(ratio: Tensor) -> dict[str, Tensor]:
    zero = ratio.new_zeros(())
    return {"clip_fraction": zero, "clip_low_fraction": zero, "clip_high_fraction": zero}


def _finish(
    objective: Tensor,
    slope: Tensor,
    derivative: Tensor,
    mask: Tensor,
    want_gradient: bool,
    probe: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """(Σ d·o over selected positions, NaN if ``probe`` = lp − lp_old + A is not finite at
    one; −d·slope with 0 on masked positions)."""
    total = torch.where(mask, objective * derivative + probe * 0.0, 0.0).sum()
    if not want_gradient:
        return total, None
    return total, torch.where(mask, slope * -derivative, 0.0)


def fused_importance_sampling(
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    derivative: Tensor,
    want_gradient: bool,
) -> FusedTerms:
    """Importance sampling: o = r·A, ∂o/∂lp = r·A."""
    log_ratio, ratio = _ratio(logprobs, sampling_logprobs)
    objective = ratio * advantages
    probe = log_ratio + advantages
    total, gradient = _finish(objective, objective, derivative, mask, want_gradient, probe)
    return FusedTerms(total, gradient, {**_ratio_statistics(ratio, mask), **_no_clips(ratio)})


def fused_ppo(
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    derivative: Tensor,
    want_gradient: bool,
    clip_low_threshold: Tensor,
    clip_high_threshold: Tensor,
    dual_clip: Tensor,
) -> FusedTerms:
    """PPO: o = min(r·A, clip(r, lo, hi)·A), then max(o, c·A) where A < 0.

    ∂o/∂lp = r·A except 0 on the clipped side (r > hi with A > 0, r < lo with A < 0) and
    where the dual clip c·A is the larger term.
    """
    log_ratio, ratio = _ratio(logprobs, sampling_logprobs)
    probe = log_ratio + advantages
    advantages = torch.where(mask, advantages, 0.0)
    negative = advantages < 0
    below = ratio < clip_low_threshold
    above = ratio > clip_high_threshold
    unclipped = ratio * advantages
    clipped = torch.minimum(
        unclipped, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages
    )
    # c·A on A < 0 only; −inf elsewhere leaves o alone (c = +inf: no dual clip at all).
    floor = torch.where(negative, dual_clip * advantages, -torch.inf)
    dual_active = floor > clipped
    objective = torch.where(dual_active, floor, clipped)
    clipped_side = ((advantages > 0) & above) | (negative & below)
    statistics = {
        **_ratio_statistics(ratio, mask),
        "clip_fraction": _count(clipped_side | (negative & (ratio > dual_clip))),
        "clip_low_fraction": _count(mask & below),
        "clip_high_fraction": _count(mask & above),
    }
    slope = torch.where(clipped_side | dual_active, 0.0, unclipped)
    total, gradient = _finish(objective, slope, derivative, mask, want_gradient, probe)
    return FusedTerms(total, gradient, statistics)


def fused_cispo(
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    derivative: Tensor,
    want_gradient: bool,
    clip_low_threshold: Tensor,
    clip_high_threshold: Tensor,
) -> FusedTerms:
    """CISPO: o = sg(clip(r, lo, hi))·lp·A, ∂o/∂lp = clip(r, lo, hi)·A."""
    log_ratio, ratio = _ratio(logprobs, sampling_logprobs)
    below = mask & (ratio < clip_low_threshold)
    above = mask & (ratio > clip_high_threshold)
    clipped_ratio = ratio.clamp(clip_low_threshold, clip_high_threshold)
    weight = clipped_ratio * advantages
    clipped_low, clipped_high = _count(below), _count(above)
    statistics = {
        **_ratio_statistics(ratio, mask),
        # r < lo and r > hi never both hold (lo <= hi): the clipped count is their sum.
        "clip_fraction": clipped_low + clipped_high,
        "clip_low_fraction": clipped_low,
        "clip_high_fraction": clipped_high,
        "clipped_ratio_mean": torch.where(mask, clipped_ratio, 0.0).sum(),
    }
    probe = log_ratio + advantages
    total, gradient = _finish(weight * logprobs, weight, derivative, mask, want_gradient, probe)
    return FusedTerms(total, gradient, statistics)


def fused_dro(
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    derivative: Tensor,
    want_gradient: bool,
    beta: Tensor,
) -> FusedTerms:
    """DRO: o = lp·A − (β/2)·(lp − lp_old)², ∂o/∂lp = A − β·(lp − lp_old)."""
    log_ratio, ratio = _ratio(logprobs, sampling_logprobs)
    objective = logprobs * advantages - beta / 2 * log_ratio * log_ratio
    slope = advantages - beta * log_ratio
    probe = log_ratio + advantages
    total, gradient = _finish(objective, slope, derivative, mask, want_gradient, probe)
    return FusedTerms(total, gradient, {**_ratio_statistics(ratio, mask), **_no_clips(ratio)})
