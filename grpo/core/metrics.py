"""Step metrics computed from records: plain string keys, float values.

- `rollout_metrics`: reward mean, share of degenerate groups, generation lengths, truncation.
- `batch_metrics`: what a packed batch trains (datums, tokens, train tokens).
- `update_metrics`: the loss kernel's metrics and the ratio statistics of one update,
  recomputed from the log-probs the trainer returned (docs/FORMULAS.md, "Ratio statistics").
- `mismatch_metrics`: the sampler–trainer mismatch of a batch from the trainer's and the
  sampler's log-probs of the same tokens (docs/FORMULAS.md, "Sampler–trainer mismatch").
- `pass_at_k`: the unbiased pass@k estimator (docs/FORMULAS.md, "pass@k").
The shell logs them; prefixes other than `rollout/` are the shell's choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from grpo.core.loss_spec import LossSpec
from grpo.core.records import ScoredGroup, TokenBatch

__all__ = ["batch_metrics", "mismatch_metrics", "pass_at_k", "rollout_metrics", "update_metrics"]

# A token is "off by 2x" when its mismatch ratio leaves [1/2, 2]: |δ| > log 2.
OFF_BY_2X_LOG = math.log(2.0)


def rollout_metrics(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """Mean reward over all completions, frac_degenerate, generation lengths and frac_truncated."""
    if not groups:
        raise ValueError(
            "rollout_metrics needs at least one group; got an empty sequence of groups"
        )
    rewards = np.concatenate([group.rewards for group in groups])
    completions = [completion for group in groups for completion in group.completions]
    generation_lens = np.array([completion.tokens.size for completion in completions])
    truncated = np.array([completion.is_truncated for completion in completions])
    degenerate = np.array([group.is_degenerate for group in groups])
    return {
        "reward": float(rewards.mean()),
        "frac_degenerate": float(degenerate.mean()),
        "rollout/avg_gen_len": float(generation_lens.mean()),
        "rollout/max_gen_len": float(generation_lens.max()),
        "rollout/frac_truncated": float(truncated.mean()),
        "num_groups": float(len(groups)),
        "num_completions": float(len(completions)),
    }


def batch_metrics(batch: TokenBatch) -> dict[str, float]:
    """Size of a packed batch: `datums` (sequences), `tokens` (N), `train_tokens` (Σ mask)."""
    return {
        "datums": float(batch.num_sequences),
        "tokens": float(batch.num_tokens),
        "train_tokens": float(batch.num_train_tokens),
    }


def update_metrics(
    spec: LossSpec, logprobs_N: npt.ArrayLike, batch: TokenBatch
) -> dict[str, float]:
    """The kernel's metrics (prefixed with its name), ``loss``, and the log-ratio statistics.

    ``ratio/max_abs_log`` = max |lp − lp_old| and ``ratio/mean`` = mean exp(lp − lp_old) over
    the masked-in tokens (0 and 1 when none), computed in float32 from the trainer's
    log-probs, so every backend and call path reports the same numbers.
    """
    mask = torch.from_numpy(np.asarray(batch.mask, dtype=np.float32))
    current = torch.from_numpy(np.asarray(logprobs_N, dtype=np.float32))
    sampled = torch.from_numpy(np.asarray(batch.sampling_logprobs, dtype=np.float32))
    with torch.no_grad():
        loss, kernel_metrics = spec(
            current,
            sampled,
            torch.from_numpy(np.asarray(batch.advantages, dtype=np.float32)),
            mask=mask,
            seq_lens=torch.tensor(batch.seq_lens),
        )
    log_ratio = (current - sampled)[mask.bool()]
    metrics = {f"{spec.name}/{key}": float(value) for key, value in kernel_metrics.items()}
    metrics["loss"] = float(loss)
    metrics["ratio/max_abs_log"] = float(log_ratio.abs().max()) if log_ratio.numel() else 0.0
    metrics["ratio/mean"] = float(log_ratio.exp().mean()) if log_ratio.numel() else 1.0
    return metrics


def mismatch_metrics(
    trainer_logprobs_N: npt.ArrayLike,
    sampler_logprobs_N: npt.ArrayLike,
    mask_N: npt.ArrayLike,
    seq_lens_B: Sequence[int] | npt.ArrayLike,
) -> dict[str, float]:
    """KL(sampler ‖ trainer) estimates and ratio spread, from δ = lp_s − lp_trainer.

    Over masked-in tokens, in float64: ``kl_k1`` = mean δ, ``kl_k3`` = mean(exp(−δ) + δ − 1),
    ``max_abs_log_ratio`` = max |δ|, ``frac_off_by_2x`` = share with ρ = exp(−δ) outside
    [1/2, 2]; over sequences with masked-in tokens, ρ_i = exp(mean_{t∈i} −δ):
    ``seq_ratio_std`` (ddof 0), ``seq_ratio_min``, ``seq_ratio_max``. No token: 0s and ratio 1.
    """
    mask = np.asarray(mask_N, dtype=bool)
    delta = np.asarray(sampler_logprobs_N, dtype=np.float64) - np.asarray(
        trainer_logprobs_N, dtype=np.float64
    )
    if delta.shape != mask.shape:
        raise ValueError(
            f"mismatch_metrics got {delta.shape[0]} log-prob pairs for {mask.shape[0]} mask "
            "entries; pass the trainer's and the sampler's log-prob of every target position"
        )
    lengths = np.asarray(seq_lens_B, dtype=np.int64)
    if int(lengths.sum()) != mask.size:
        raise ValueError(
            f"seq_lens sum to {int(lengths.sum())} but there are {mask.size} positions"
        )
    if not mask.any():
        return {
            "kl_k1": 0.0,
            "kl_k3": 0.0,
            "max_abs_log_ratio": 0.0,
            "frac_off_by_2x": 0.0,
            "seq_ratio_std": 0.0,
            "seq_ratio_min": 1.0,
            "seq_ratio_max": 1.0,
        }
    selected = delta[mask]
    segments = np.repeat(np.arange(lengths.size), lengths)[mask]
    counts = np.bincount(segments, minlength=lengths.size)
    sums = np.bincount(segments, weights=-selected, minlength=lengths.size)
    seq_ratio = np.exp(sums[counts > 0] / counts[counts > 0])
    return {
        "kl_k1": float(selected.mean()),
        "kl_k3": float((np.expm1(-selected) + selected).mean()),
        "max_abs_log_ratio": float(np.abs(selected).max()),
        "frac_off_by_2x": float((np.abs(selected) > OFF_BY_2X_LOG).mean()),
        "seq_ratio_std": float(seq_ratio.std()),
        "seq_ratio_min": float(seq_ratio.min()),
        "seq_ratio_max": float(seq_ratio.max()),
    }


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n − c, k) / C(n, k), c correct of n samples (Chen et al., 2021)."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"pass_at_k needs 0 <= num_correct <= num_samples and 1 <= k <= num_samples, got "
            f"n={num_samples}, c={num_correct}, k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)
