"""Step metrics computed from records: plain string keys, float values.

- `rollout_metrics`: reward mean, share of degenerate groups, generation lengths, truncation.
- `batch_metrics`: what a packed batch trains (datums, tokens, train tokens).
The shell logs them; prefixes other than `rollout/` are the shell's choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grpo.core.records import ScoredGroup, TokenBatch

__all__ = ["batch_metrics", "rollout_metrics"]


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
