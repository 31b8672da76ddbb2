"""Tests for grpo.core.metrics: rollout and batch metrics from records."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.alignment import pack_groups
from grpo.core.metrics import batch_metrics, rollout_metrics
from grpo.core.records import Completion, ScoredGroup
from tests.strategies import scored_groups


def _completion(length: int, stop_reason: str) -> Completion:
    return Completion(
        tokens=np.arange(length), logprobs=np.full(length, -1.0), text="", stop_reason=stop_reason
    )


def test_rollout_metrics_of_a_small_example():
    learning = ScoredGroup(
        prompt_tokens=[1, 2, 3],
        completions=[_completion(4, "stop"), _completion(10, "length")],
        rewards=[1.0, 0.0],
        advantages=[0.5, -0.5],
    )
    degenerate = attrs.evolve(
        learning,
        completions=[_completion(2, "stop"), _completion(4, "stop")],
        rewards=[1.0, 1.0],
        advantages=[0.0, 0.0],
    )
    assert rollout_metrics([learning, degenerate]) == {
        "reward": 0.75,
        "frac_degenerate": 0.5,
        "rollout/avg_gen_len": 5.0,
        "rollout/max_gen_len": 10.0,
        "rollout/frac_truncated": 0.25,
        "num_groups": 2.0,
        "num_completions": 4.0,
    }


@given(groups=st.lists(scored_groups(), min_size=1, max_size=5))
def test_rollout_metrics_average_over_completions_not_groups(groups):
    completions = [completion for group in groups for completion in group.completions]
    metrics = rollout_metrics(groups)
    assert metrics["reward"] == pytest.approx(
        np.mean([r for group in groups for r in group.rewards])
    )
    assert metrics["rollout/avg_gen_len"] == pytest.approx(
        np.mean([c.tokens.size for c in completions])
    )
    assert metrics["rollout/max_gen_len"] == max(c.tokens.size for c in completions)
    assert metrics["rollout/frac_truncated"] == pytest.approx(
        np.mean([c.stop_reason == "length" for c in completions])
    )
    assert metrics["frac_degenerate"] == pytest.approx(
        np.mean([group.is_degenerate for group in groups])
    )
    assert (metrics["num_groups"], metrics["num_completions"]) == (len(groups), len(completions))
    assert all(isinstance(value, float) for value in metrics.values())


def test_rollout_metrics_of_no_groups_is_an_error():
    with pytest.raises(ValueError, match="at least one group"):
        rollout_metrics([])


@given(groups=st.lists(scored_groups(), max_size=5))
def test_batch_metrics_count_datums_and_train_tokens(groups):
    batch = pack_groups(groups)
    kept = [
        (group.prompt_tokens.size, completion.tokens.size)
        for group in groups
        if not group.is_degenerate
        for completion in group.completions
    ]
    # Each completion of length c after a prompt of length p aligns to p + c - 1 positions.
    assert batch_metrics(batch) == {
        "datums": float(len(kept)),
        "tokens": float(sum(prompt + completion - 1 for prompt, completion in kept)),
        "train_tokens": float(sum(completion for _, completion in kept)),
    }
