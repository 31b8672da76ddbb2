"""Group advantages: how much better each completion scored than the others of its prompt.

For the rewards R_1..R_G of one prompt (docs/FORMULAS.md "Group advantages"):
- `center` (seed demo, Dr. GRPO): A_i = R_i − mean(R)
- `standardize` (DeepSeekMath): A_i = (R_i − mean(R)) / (std(R) + ε), std with ddof 0, ε = 1e-8
- `rloo` (leave one out): A_i = R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − mean(R)); 0 when G = 1
- `batch_standardize`: A_i = (R_i − mean(R)) / (std of all centered rewards in the batch + ε)

A group is degenerate when all its rewards are equal: its advantages are exactly 0 (set,
not computed, so rounding in the mean cannot leave a residue) and it is flagged.

Guard against near-constant groups: the ε in the denominator bounds the result, because
|R_i − mean(R)| <= sqrt(G−1)·std(R) for ddof 0, so |A_i| < sqrt(G−1) for `standardize`
whatever the spread (rewards 0 and 1e-12 give ±1e-4, not ±1); for `batch_standardize`
|A_i| < sqrt(N−1) over the N completions of the batch; `center` and `rloo` never divide
and stay within the group's reward range times G/(G−1).

`group_advantages` computes any variant for a whole batch of ragged groups at once
(flat rewards + group sizes, `np.add.reduceat` per group, `np.repeat` back to completions).

`kl_shaped_advantages` folds a KL-to-reference penalty into token advantages
(docs/FORMULAS.md, "KL shaping"): A_t − β·k(lp_old_t − lp_ref_t) on trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from grpo.core.arrays import as_1d, require_finite, require_kind
from grpo.core.kl import kl_penalty
from grpo.core.records import GroupAdvantages

__all__ = [
    "ADVANTAGES",
    "STD_EPSILON",
    "batch_standardize",
    "center",
    "center_groups",
    "degenerate_groups",
    "group_advantages",
    "kl_shaped_advantages",
    "rloo",
    "rloo_groups",
    "standardize",
    "standardize_groups",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
AdvantageFn = Callable[[npt.ArrayLike, npt.ArrayLike], FloatArray]

STD_EPSILON = 1e-8


def _as_rewards(rewards: npt.ArrayLike, field_name: str) -> FloatArray:
    array = as_1d(rewards, field_name, of=" of rewards")
    require_kind(array, field_name, "iuf", "real numbers")
    array = array.astype(np.float64)
    require_finite(
        array, field_name, "rewards must be finite numbers (grade failures as 0, not NaN)"
    )
    return array


def _as_group(rewards_G: npt.ArrayLike) -> FloatArray:
    rewards = _as_rewards(rewards_G, "rewards_G")
    if rewards.size == 0:
        raise ValueError("rewards_G is empty: a group has at least one completion")
    return rewards


def _centered(rewards_G: FloatArray) -> FloatArray:
    if np.all(rewards_G == rewards_G[0]):
        return np.zeros_like(rewards_G)
    return rewards_G - rewards_G.mean()


def center(rewards_G: npt.ArrayLike) -> FloatArray:
    """A_i = R_i − mean(R) for one group (0 for a degenerate group)."""
    return _centered(_as_group(rewards_G))


def standardize(rewards_G: npt.ArrayLike) -> FloatArray:
    """A_i = (R_i − mean(R)) / (std(R) + 1e-8), std with ddof 0, for one group."""
    centered = _centered(_as_group(rewards_G))
    std = np.sqrt(np.mean(centered**2))
    return centered / (std + STD_EPSILON)


def rloo(rewards_G: npt.ArrayLike) -> FloatArray:
    """A_i = R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − mean(R)) for one group; zeros when G = 1."""
    rewards = _as_group(rewards_G)
    group_size = rewards.size
    if group_size == 1:
        return np.zeros(1)
    return group_size / (group_size - 1) * _centered(rewards)


def _as_batch(
    rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike
) -> tuple[FloatArray, IntArray]:
    rewards = _as_rewards(rewards_N, "rewards_N")
    sizes = as_1d(group_sizes_B, "group_sizes_B")
    require_kind(sizes, "group_sizes_B", "iu", "integers")
    sizes = sizes.astype(np.int64)
    if (sizes < 1).any():
        raise ValueError(
            f"group_sizes_B must all be >= 1, got {sizes.tolist()}; drop empty groups before "
            "computing advantages"
        )
    if int(sizes.sum()) != rewards.size:
        raise ValueError(
            f"group_sizes_B sum to {int(sizes.sum())} but rewards_N has {rewards.size} entries; "
            "list the size of every group, in order"
        )
    return rewards, sizes


def _group_starts(sizes: IntArray) -> IntArray:
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def _degenerate(rewards: FloatArray, starts: IntArray) -> BoolArray:
    return np.maximum.reduceat(rewards, starts) == np.minimum.reduceat(rewards, starts)


def _centered_groups(rewards: FloatArray, sizes: IntArray) -> FloatArray:
    """R_i − mean of its group, exactly 0 in degenerate groups (inputs already validated)."""
    if sizes.size == 0:
        return np.zeros(0)
    starts = _group_starts(sizes)
    means_B = np.add.reduceat(rewards, starts) / sizes
    centered = rewards - np.repeat(means_B, sizes)
    return np.where(np.repeat(_degenerate(rewards, starts), sizes), 0.0, centered)


def degenerate_groups(rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike) -> BoolArray:
    """One flag per group: True when all rewards of the group are equal."""
    rewards, sizes = _as_batch(rewards_N, group_sizes_B)
    if sizes.size == 0:
        return np.zeros(0, dtype=bool)
    return _degenerate(rewards, _group_starts(sizes))


def center_groups(rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike) -> FloatArray:
    """`center` of every group of a flat ragged batch: A_i = R_i − mean(R of i's group)."""
    return _centered_groups(*_as_batch(rewards_N, group_sizes_B))


def standardize_groups(rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike) -> FloatArray:
    """`standardize` of every group: (R_i − mean) / (std_ddof0 + 1e-8), mean and std per group."""
    rewards, sizes = _as_batch(rewards_N, group_sizes_B)
    if sizes.size == 0:
        return np.zeros(0)
    centered = _centered_groups(rewards, sizes)
    std_B = np.sqrt(np.add.reduceat(centered**2, _group_starts(sizes)) / sizes)
    return centered / np.repeat(std_B + STD_EPSILON, sizes)


def rloo_groups(rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike) -> FloatArray:
    """`rloo` of every group: G/(G−1)·(R_i − mean), 0 in groups of one."""
    rewards, sizes = _as_batch(rewards_N, group_sizes_B)
    # A group of one is degenerate, so its centered value is 0 and any finite factor works.
    scale_B = sizes / np.maximum(sizes - 1, 1)
    return _centered_groups(rewards, sizes) * np.repeat(scale_B, sizes)


def batch_standardize(rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike) -> FloatArray:
    """A_i = (R_i − mean of i's group) / (std_ddof0 of all centered rewards of the batch + 1e-8).

    Degenerate groups contribute their zeros to the batch std, as the formula reads.
    """
    centered = _centered_groups(*_as_batch(rewards_N, group_sizes_B))
    if centered.size == 0:
        return centered
    return centered / (np.std(centered) + STD_EPSILON)


ADVANTAGES: dict[str, AdvantageFn] = {
    "center": center_groups,
    "standardize": standardize_groups,
    "rloo": rloo_groups,
    "batch_standardize": batch_standardize,
}


def group_advantages(
    rewards_N: npt.ArrayLike, group_sizes_B: npt.ArrayLike, method: str
) -> GroupAdvantages:
    """Advantages of every completion of a ragged batch by the named method, degenerate flags."""
    advantage_fn = ADVANTAGES.get(method)
    if advantage_fn is None:
        raise ValueError(
            f"unknown advantage method {method!r}; choose one of {', '.join(ADVANTAGES)}"
        )
    rewards, sizes = _as_batch(rewards_N, group_sizes_B)
    degenerate_B = (
        _degenerate(rewards, _group_starts(sizes)) if sizes.size else np.zeros(0, dtype=bool)
    )
    return GroupAdvantages(
        advantages=advantage_fn(rewards, sizes), group_sizes=sizes, degenerate=degenerate_B
    )


def kl_shaped_advantages(
    advantages_N: npt.ArrayLike,
    sampling_logprobs_N: npt.ArrayLike,
    ref_logprobs_N: npt.ArrayLike,
    mask_N: npt.ArrayLike,
    *,
    kl_coef: float,
    estimator: str,
) -> tuple[FloatArray, float]:
    """(A_t − kl_coef·k(lp_old_t − lp_ref_t) on masked-in tokens and 0 elsewhere, mean k over them).

    Reward shaping rather than a loss term, so it works with the service's built-in losses
    too; k is a KL estimator of `grpo.core.kl.KL_ESTIMATORS`. The mean is 0 for an empty mask.
    """
    mask = np.asarray(mask_N, dtype=bool)
    advantages = np.asarray(advantages_N, dtype=np.float64)
    sampled = torch.tensor(np.asarray(sampling_logprobs_N), dtype=torch.float64)
    reference = torch.tensor(np.asarray(ref_logprobs_N), dtype=torch.float64)
    if not advantages.shape == mask.shape == tuple(sampled.shape) == tuple(reference.shape):
        raise ValueError(
            f"advantages {advantages.shape}, sampling_logprobs {tuple(sampled.shape)}, "
            f"ref_logprobs {tuple(reference.shape)} and mask {mask.shape} must have one shape"
        )
    kl_N = kl_penalty(sampled, reference, estimator=estimator).numpy() * mask
    shaped_N = np.where(mask, advantages - kl_coef * kl_N, 0.0)
    return shaped_N, float(kl_N.sum() / max(mask.sum(), 1))
