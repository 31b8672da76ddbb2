"""Step metrics computed from records: plain string keys, float values.

- `rollout_metrics`: reward mean, share of degenerate groups, generation lengths, truncation.
- `batch_metrics`: what a packed batch trains (datums, tokens, train tokens).
- `update_metrics`: the loss kernel's metrics and the ratio statistics of one update,
  recomputed from the log-probs the trainer returned (docs/FORMULAS.md, "Ratio statistics").
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

__all__ = ["batch_metrics", "pass_at_k", "rollout_metrics", "update_metrics"]


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


def update_metrics(spec: LossSpec, logprobs_N: npt.ArrayLike, batch: TokenBatch) -> dict[str, float]:
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


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n − c, k) / C(n, k) for c correct of n samples (Chen et al., 2021)."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"pass_at_k needs 0 <= num_correct <= num_samples and 1 <= k <= num_samples, got "
            f"n={num_samples}, c={num_correct}, k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)
