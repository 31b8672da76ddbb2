"""Sampler–trainer mismatch corrections: truncated and masked importance sampling.

docs/FORMULAS.md, "Sampler–trainer mismatch". Three log-probs of a sampled token:
``lp_s`` the sampler's (the datum's ``logprobs``), ``lp_prox`` the trainer's at the start
of the step (no grad) and ``lp`` the current one. The mismatch ratio is
``ρ_t = exp(lp_prox − lp_s)``, per sequence ``ρ_i = exp(mean_{t∈i} (lp_prox − lp_s))``.
A correction trains the kernel decoupled: its ratio becomes ``exp(lp − lp_prox)`` and its
objective is weighted per token by a stop-gradient factor ``w``:

- ``token_truncate`` (truncated IS, Yao et al. 2025): ``w_t = min(ρ_t, C)``
- ``token_mask`` (masked IS, IcePop): ``w_t = 1`` if ``lo ≤ ρ_t ≤ hi`` else 0
- ``sequence_truncate`` / ``sequence_mask``: the same with ``ρ_i`` on every token of i
- ``recompute``: ``w = 1``: the trainer's own log-probs replace the sampler's as the
  behaviour policy (verl's recomputed ``old_log_prob``): the ratio starts at 1 at any
  temperature, on any backend; the mismatch is ignored, not corrected (any policy kernel)

Every kernel whose objective is linear in the advantage (``importance_sampling``, ``ppo``
with or without dual clip, ``cispo``; ``gspo`` at sequence level) satisfies
``f(r, w·A) = w·f(r, A)`` for ``w ≥ 0``, so ``correct_batch`` folds ``w`` into the
advantages and puts ``lp_prox`` in place of the sampling log-probs: the eager and the
fused kernel, PyTRIO's built-in losses and ``as_custom_loss`` then all train the
corrected objective unchanged. A masked token keeps its place in the mask (w = 0 removes
its signal, not its share of a mean's denominator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from grpo.core.records import TokenBatch

__all__ = [
    "CORRECTED_LOSSES",
    "MISMATCH_CORRECTIONS",
    "MismatchCorrection",
    "correct_batch",
    "mismatch_weights",
]

MISMATCH_CORRECTIONS: tuple[str, ...] = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "recompute",
)
# The kernels whose objective is linear in A (so w folds into the advantage), by level.
CORRECTED_LOSSES: dict[str, tuple[str, ...]] = {
    "token": ("importance_sampling", "ppo", "cispo"),
    "sequence": ("importance_sampling", "ppo", "cispo", "gspo"),
}


def _check_mode(_instance: object, _attribute: object, mode: str) -> None:
    if mode not in MISMATCH_CORRECTIONS:
        raise ValueError(
            f"mismatch correction {mode!r} is not one of {', '.join(MISMATCH_CORRECTIONS)}"
        )


@attrs.frozen
class MismatchCorrection:
    """A correction ``mode`` with its cap ``C`` (truncate) and ratio bounds ``[low, high]`` (mask).

    C ≥ 1 and low ≤ 1 ≤ high, so a token the sampler and trainer agree on (ρ = 1) always
    trains with weight 1.
    """

    mode: str = attrs.field(default="none", validator=_check_mode)
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __attrs_post_init__(self) -> None:
        if not (self.cap >= 1 and not math.isnan(self.cap)):
            raise ValueError(f"mismatch cap C must be >= 1 (e.g. 2.0), got {self.cap}")
        if not (0 <= self.low <= 1 <= self.high):
            raise ValueError(
                f"mismatch mask bounds must satisfy 0 <= low <= 1 <= high (e.g. 0.5 and 2.0), "
                f"got low={self.low}, high={self.high}"
            )

    @property
    def enabled(self) -> bool:
        """Whether any correction is applied (mode is not ``none``)."""
        return self.mode != "none"

    @property
    def level(self) -> str:
        """``token`` or ``sequence`` (``none`` counts as token)."""
        return "sequence" if self.mode.startswith("sequence") else "token"

    @property
    def truncates(self) -> bool:
        """True for the truncated-IS modes, False for the masking modes."""
        return self.mode.endswith("truncate")

    def check_loss(self, loss_name: str) -> None:
        """ValueError unless this correction is defined for kernel ``loss_name``."""
        if self.mode == "recompute" and loss_name != "cross_entropy":
            return
        if self.enabled and loss_name not in CORRECTED_LOSSES[self.level]:
            raise ValueError(
                f"mismatch correction {self.mode!r} needs a kernel linear in the advantage "
                f"({', '.join(CORRECTED_LOSSES[self.level])}), got loss {loss_name!r}"
                + (
                    "; with gspo use sequence_truncate or sequence_mask"
                    if loss_name == "gspo"
                    else ""
                )
            )


def _segment_ids(seq_lens: Sequence[int] | Tensor, size: int) -> Tensor:
    lengths = torch.as_tensor(seq_lens, dtype=torch.long).reshape(-1)
    if int(lengths.sum()) != size:
        raise ValueError(
            f"seq_lens sum to {int(lengths.sum())} but the log-probs have {size} entries"
        )
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def mismatch_weights(
    proximal_N: Tensor,
    sampling_N: Tensor,
    mask_N: Tensor,
    seq_lens: Sequence[int] | Tensor,
    correction: MismatchCorrection,
) -> tuple[Tensor, dict[str, float]]:
    """The detached float64 weights w (0 where m = 0) and ``frac_truncated`` / ``frac_masked``.

    Token modes use ρ_t = exp(lp_prox − lp_s); sequence modes ρ_i = exp(mean_{t∈i}(lp_prox −
    lp_s)) on every token of i (a sequence without masked-in tokens gets ρ_i = 1). The
    fraction is over masked-in tokens (0 when none is): ρ > C when truncating, ρ outside
    [low, high] when masking; ``none`` and ``recompute`` give w = 1 and no fraction.
    """
    selected = mask_N.detach().to(torch.float64) != 0
    log_ratio = torch.where(
        selected,
        proximal_N.detach().to(torch.float64) - sampling_N.detach().to(torch.float64),
        0.0,
    )
    if correction.level == "sequence":
        segments = _segment_ids(seq_lens, log_ratio.numel())
        count_B = torch.zeros(
            int(segments.max()) + 1 if segments.numel() else 0, dtype=torch.float64
        )
        count_B.index_add_(0, segments, selected.to(torch.float64))
        sum_B = torch.zeros_like(count_B).index_add_(0, segments, log_ratio)
        log_ratio = (sum_B / count_B.clamp(min=1.0))[segments]
    ratio = log_ratio.exp()
    if correction.mode in ("none", "recompute"):
        weights, affected = torch.ones_like(ratio), torch.zeros_like(selected)
    elif correction.truncates:
        weights, affected = ratio.clamp(max=correction.cap), ratio > correction.cap
    else:
        affected = (ratio < correction.low) | (ratio > correction.high)
        weights = (~affected).to(torch.float64)
    weights = torch.where(selected, weights, 0.0)
    count = int(selected.sum())
    fraction = float((affected & selected).sum()) / count if count else 0.0
    metrics = {"weight_mean": float(weights[selected].mean()) if count else 0.0}
    if correction.mode.endswith(("truncate", "mask")):
        metrics["frac_truncated" if correction.truncates else "frac_masked"] = fraction
    return weights, metrics


def correct_batch(
    batch: TokenBatch, proximal_N: npt.ArrayLike, correction: MismatchCorrection
) -> tuple[TokenBatch, dict[str, float]]:
    """The batch trained decoupled: sampling log-probs ← lp_prox, advantages ← w·A; and metrics.

    ``proximal_N`` is the trainer's log-prob of every target position at the step's start
    (only masked-in entries are read). The mask is unchanged.
    """
    proximal = np.asarray(proximal_N, dtype=np.float64)
    if proximal.shape != batch.sampling_logprobs.shape:
        raise ValueError(
            f"proximal log-probs have shape {proximal.shape} but the batch has "
            f"{batch.sampling_logprobs.shape[0]} positions; pass one per target position"
        )
    mask = np.asarray(batch.mask, dtype=bool)
    proximal = np.where(mask, proximal, 0.0)
    weights, metrics = mismatch_weights(
        torch.from_numpy(proximal),
        torch.from_numpy(np.array(batch.sampling_logprobs, dtype=np.float64)),
        torch.from_numpy(mask.copy()),
        batch.seq_lens,
        correction,
    )
    corrected = attrs.evolve(
        batch,
        sampling_logprobs=proximal,
        advantages=np.asarray(batch.advantages, dtype=np.float64) * weights.numpy(),
    )
    return corrected, metrics
