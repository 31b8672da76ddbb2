"""On-policy distillation: token advantages from a teacher's log-probs (docs/FORMULAS.md,
"On-policy distillation").

Over a packed batch (N positions, sequences end to end with lengths ``seq_lens_B``), with
the student's log-probs s, the teacher's q of the same sampled tokens and the mask m of the
completion tokens:

- `teacher_positions`: where the teacher's ``compute_logprobs(x_T + y)`` entries for y go
  (its last |y| entries, since entry k is log p(token_k | tokens_<k)).
- `discounted_suffix_sums`: x_t = Σ_{k ≥ t, same sequence} γ^(k−t) v_k, by a doubling scan.
- `distill_advantages`: A_t = w·Â_t − Σ_{k≥t} γ^(k−t) clamp(c·(s_k − q_k), ±κ) on m, 0 off it.
- `distill_metrics`: reverse KL (k1 mean and k3 mean), mean s, mean q, fraction clipped.

Plain reference implementations (one Python loop each) live in the tests.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "DistillTerms",
    "discounted_suffix_sums",
    "distill_advantages",
    "distill_metrics",
    "teacher_logprobs_at",
]

FloatArray = npt.NDArray[np.float64]


def _segments(seq_lens_B: npt.ArrayLike, num_positions: int) -> npt.NDArray[np.int64]:
    """The sequence index of every packed position (ValueError if the lengths do not cover N)."""
    lens = np.asarray(seq_lens_B, dtype=np.int64)
    if lens.ndim != 1 or (lens < 0).any() or int(lens.sum()) != num_positions:
        raise ValueError(
            f"seq_lens_B {lens.tolist()[:8]} must be lengths >= 0 summing to the {num_positions} "
            "packed positions"
        )
    return np.repeat(np.arange(lens.size), lens)


def discounted_suffix_sums(
    values_N: npt.ArrayLike, seq_lens_B: npt.ArrayLike, discount: float
) -> FloatArray:
    """x_t = Σ_{k ≥ t in t's sequence} γ^(k−t) v_k for every position (γ = ``discount``).

    A doubling scan: after the pass with shift s, x_t sums the window t..t+2s−1 (cut at the
    end of t's sequence), so ceil(log2(longest sequence)) vectorized passes suffice. γ = 0
    returns v; γ = 1 is the reverse cumulative sum within each sequence.
    """
    values = np.asarray(values_N, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"values_N must be 1-D, got shape {values.shape}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    segment_N = _segments(seq_lens_B, values.size)
    sums = values.copy()
    if discount == 0.0 or values.size == 0:
        return sums
    longest = int(np.max(np.asarray(seq_lens_B, dtype=np.int64), initial=0))
    shift = 1
    while shift < longest:
        ahead = np.zeros_like(sums)
        same = segment_N[shift:] == segment_N[:-shift]
        ahead[:-shift] = np.where(same, sums[shift:], 0.0)
        sums = sums + discount**shift * ahead
        shift *= 2
    return sums


def teacher_logprobs_at(
    teacher_logprobs: list[float | None] | npt.ArrayLike, positions: npt.ArrayLike
) -> FloatArray:
    """q of the sampled tokens of a stream from ``compute_logprobs(stream)``: its ``positions``.

    Entry k is log p(token_k | tokens_<k) (None for k = 0); an episode's sampled tokens are
    its action positions (never 0: a turn follows an observation), observations are skipped.
    """
    entries = list(teacher_logprobs)
    at = np.asarray(positions, dtype=np.int64)
    if at.size and (at.min() < 1 or at.max() >= len(entries)):
        raise ValueError(
            f"teacher log-probs have {len(entries)} entries; sampled positions run "
            f"{int(at.min())}..{int(at.max())} (compute_logprobs must score the whole stream)"
        )
    values = [entries[k] for k in at.tolist()]
    if any(value is None for value in values):
        raise ValueError("the teacher returned None for a sampled token's log-prob")
    return np.asarray(values, dtype=np.float64)


@attrs.frozen
class DistillTerms:
    """The distillation advantages of a batch and the per-position pieces its metrics read."""

    advantages_N: FloatArray
    clipped_N: npt.NDArray[np.bool_]


def distill_advantages(
    task_advantages_N: npt.ArrayLike,
    student_logprobs_N: npt.ArrayLike,
    teacher_logprobs_N: npt.ArrayLike,
    mask_N: npt.ArrayLike,
    seq_lens_B: npt.ArrayLike,
    *,
    coef: float,
    discount: float,
    task_weight: float,
    clip: float = 0.0,
) -> DistillTerms:
    """A_t = w·Â_t − Σ_{k≥t} γ^(k−t) p_k with p_k = clamp(c·(s_k − q_k), ±κ) (κ = 0: none).

    On masked-in positions (m = 1); 0 elsewhere, and p = 0 off the mask, so a prompt position
    or a masked sequence adds nothing to any suffix sum. ``clipped_N`` flags |c·d_t| > κ.
    """
    mask = np.asarray(mask_N, dtype=np.float64) > 0
    task = np.asarray(task_advantages_N, dtype=np.float64)
    student = np.asarray(student_logprobs_N, dtype=np.float64)
    teacher = np.asarray(teacher_logprobs_N, dtype=np.float64)
    if not task.shape == student.shape == teacher.shape == mask.shape:
        raise ValueError(
            f"task_advantages {task.shape}, student_logprobs {student.shape}, teacher_logprobs "
            f"{teacher.shape} and mask {mask.shape} must have one shape (one entry a position)"
        )
    if coef < 0 or task_weight < 0 or clip < 0:
        raise ValueError(f"coef {coef}, task_weight {task_weight} and clip {clip} must all be >= 0")
    penalty_N = np.where(mask, coef * (student - teacher), 0.0)
    clipped_N = mask & (np.abs(penalty_N) > clip) if clip > 0 else np.zeros_like(mask)
    if clip > 0:
        penalty_N = np.clip(penalty_N, -clip, clip)
    returns_N = discounted_suffix_sums(penalty_N, seq_lens_B, discount)
    advantages_N = np.where(mask, task_weight * task - returns_N, 0.0)
    return DistillTerms(advantages_N=advantages_N, clipped_N=clipped_N)


def distill_metrics(
    student_logprobs_N: npt.ArrayLike,
    teacher_logprobs_N: npt.ArrayLike,
    mask_N: npt.ArrayLike,
    clipped_N: npt.ArrayLike | None = None,
) -> dict[str, float]:
    """Means over masked-in positions of d = s − q (k1), exp(−d) + d − 1 (k3), s, q; clipped.

    All 0 when no position is masked in.
    """
    mask = np.asarray(mask_N, dtype=np.float64) > 0
    student = np.asarray(student_logprobs_N, dtype=np.float64)[mask]
    teacher = np.asarray(teacher_logprobs_N, dtype=np.float64)[mask]
    clipped = (
        np.zeros(int(mask.sum()), dtype=bool)
        if clipped_N is None
        else np.asarray(clipped_N, dtype=bool)[mask]
    )
    if student.size == 0:
        return {
            "distill/reverse_kl": 0.0,
            "distill/reverse_kl_k3": 0.0,
            "distill/student_logprob": 0.0,
            "distill/teacher_logprob": 0.0,
            "distill/frac_clipped": 0.0,
        }
    delta = student - teacher
    return {
        "distill/reverse_kl": float(delta.mean()),
        "distill/reverse_kl_k3": float((np.expm1(-delta) + delta).mean()),
        "distill/student_logprob": float(student.mean()),
        "distill/teacher_logprob": float(teacher.mean()),
        "distill/frac_clipped": float(clipped.mean()),
    }
