"""Tests for grpo.core.records: invalid records cannot be built; valid ones are frozen."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.records import (
    LOGPROB_POSITIVE_TOLERANCE,
    AlignedSequence,
    Completion,
    GroupAdvantages,
    ScoredGroup,
    TokenBatch,
)
from tests.strategies import completions, scored_groups

COMPLETION = Completion(
    tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], text="567", stop_reason="stop"
)
GROUP = ScoredGroup(
    prompt_tokens=[1, 2],
    completions=[COMPLETION, COMPLETION],
    rewards=[1.0, 0.0],
    advantages=[0.5, -0.5],
)
SEQUENCE = AlignedSequence(
    input_tokens=[1, 2, 5],
    target_tokens=[0, 5, 6],
    sampling_logprobs=[0.0, -0.1, -0.2],
    advantages=[0.0, 0.5, 0.5],
    mask=[0.0, 1.0, 1.0],
)
BATCH = TokenBatch(
    input_tokens=[1, 2, 5, 3, 4],
    target_tokens=[0, 5, 6, 4, 8],
    sampling_logprobs=[0.0, -0.1, -0.2, -1.0, -2.0],
    advantages=[0.0, 0.5, 0.5, -1.0, -1.0],
    mask=[0.0, 1.0, 1.0, 1.0, 1.0],
    seq_lens=[3, 2],
)


@pytest.mark.parametrize(
    ("record", "changes", "message"),
    [
        (
            COMPLETION,
            dict(tokens=[], logprobs=[]),
            r"completion is empty \(tokens has 0 entries\).*raise max_tokens",
        ),
        (COMPLETION, dict(logprobs=[-0.1, -0.2]), "logprobs has 2 entries but tokens has 3"),
        (
            COMPLETION,
            dict(logprobs=[-0.1, float("nan"), -0.3]),
            "logprobs has a non-finite value nan at index 1",
        ),
        (
            COMPLETION,
            dict(logprobs=[-0.1, -0.2, float("-inf")]),
            "logprobs has a non-finite value -inf at index 2",
        ),
        (
            COMPLETION,
            dict(logprobs=[-0.1, 0.5, -0.3]),
            "logprobs has a positive value 0.5 at index 1.*not logits",
        ),
        (COMPLETION, dict(tokens=[5, -6, 7]), "tokens has a negative token id -6 at index 1"),
        (COMPLETION, dict(tokens=[5.0, 6.5, 7.0]), "tokens must hold integers, got dtype float64"),
        (COMPLETION, dict(tokens=[[5, 6, 7]]), r"tokens must be a 1-D array, got shape \(1, 3\)"),
        (COMPLETION, dict(text=None), "'text' must be <class 'str'>"),
        (GROUP, dict(prompt_tokens=[]), "prompt_tokens is empty"),
        (GROUP, dict(completions=[], rewards=[], advantages=[]), "completions is empty"),
        (
            GROUP,
            dict(completions=[COMPLETION, "text"]),
            r"completions\[1\] is a str, not a Completion",
        ),
        (GROUP, dict(rewards=[1.0]), "rewards has 1 entries but the group has 2 completions"),
        (
            GROUP,
            dict(advantages=[0.5, -0.5, 0.0]),
            "advantages has 3 entries but the group has 2 completions",
        ),
        (GROUP, dict(rewards=[1.0, float("nan")]), "rewards has a non-finite value nan at index 1"),
        (
            GROUP,
            dict(advantages=[float("inf"), 0.0]),
            "advantages has a non-finite value inf at index 0",
        ),
        (
            SEQUENCE,
            dict(input_tokens=[], target_tokens=[], sampling_logprobs=[], advantages=[], mask=[]),
            "input_tokens is empty",
        ),
        (
            SEQUENCE,
            dict(target_tokens=[0, 5]),
            "target_tokens has 2 entries but input_tokens has 3",
        ),
        (SEQUENCE, dict(mask=[0.0, 1.0]), "mask has 2 entries but input_tokens has 3"),
        (
            SEQUENCE,
            dict(mask=[0.0, 0.5, 1.0]),
            "mask must hold only 0.0 and 1.0, got 0.5 at index 1",
        ),
        (
            SEQUENCE,
            dict(sampling_logprobs=[0.0, float("nan"), 0.0]),
            "sampling_logprobs has a non-finite value nan",
        ),
        (
            SEQUENCE,
            dict(advantages=[0.0, float("inf"), 0.0]),
            "advantages has a non-finite value inf",
        ),
        (SEQUENCE, dict(target_tokens=[-1, 5, 6]), "target_tokens has a negative token id -1"),
        (BATCH, dict(seq_lens=[3, 3]), "seq_lens sum to 6 but the packed arrays have 5 positions"),
        (BATCH, dict(seq_lens=[5, 0]), "seq_lens has a length < 1: 0 at index 1"),
        (
            BATCH,
            dict(advantages=[0.0, 0.5, 0.5, -1.0]),
            "advantages has 4 entries but input_tokens has 5",
        ),
        (
            BATCH,
            dict(mask=[0.0, 1.0, 1.0, 2.0, 1.0]),
            "mask must hold only 0.0 and 1.0, got 2.0 at index 3",
        ),
    ],
)
def test_an_invalid_record_cannot_be_built(record, changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        attrs.evolve(record, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(degenerate=[True]), "degenerate has 1 entries but group_sizes has 2"),
        (
            dict(group_sizes=[3, 0], degenerate=[False, True]),
            r"group_sizes must all be >= 1, got \[3, 0\]",
        ),
        (dict(group_sizes=[1, 1]), "group_sizes sum to 2 but advantages has 3 entries"),
        (dict(advantages=[0.5, -0.5, float("nan")]), "advantages has a non-finite value nan"),
        (dict(degenerate=[0, 1]), "degenerate must hold booleans, got dtype int64"),
    ],
)
def test_invalid_group_advantages_cannot_be_built(changes, message):
    fields = dict(advantages=[0.5, -0.5, 0.0], group_sizes=[2, 1], degenerate=[False, True])
    fields.update(changes)
    with pytest.raises((ValueError, TypeError), match=message):
        GroupAdvantages(**fields)


def test_a_log_prob_within_the_rounding_tolerance_above_zero_is_accepted():
    completion = attrs.evolve(COMPLETION, logprobs=[-0.1, LOGPROB_POSITIVE_TOLERANCE, 0.0])
    assert completion.logprobs[1] == LOGPROB_POSITIVE_TOLERANCE


def test_record_arrays_have_fixed_dtypes_and_are_read_only():
    completion = Completion(
        tokens=np.array([1, 2], dtype=np.int32),
        logprobs=np.array([-1, -2], dtype=np.float32),
        text="",
        stop_reason="stop",
    )
    assert completion.tokens.dtype == np.int64 and completion.logprobs.dtype == np.float64
    for array in (
        completion.tokens,
        completion.logprobs,
        GROUP.rewards,
        SEQUENCE.mask,
        BATCH.seq_lens,
    ):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0


def test_a_record_copies_a_writable_input_so_later_writes_do_not_reach_it():
    tokens = np.array([5, 6, 7])
    completion = attrs.evolve(COMPLETION, tokens=tokens)
    tokens[0] = 99
    assert completion.tokens[0] == 5


def test_a_read_only_view_of_a_writable_array_is_copied():
    tokens = np.array([5, 6, 7])
    view = tokens[:]
    view.setflags(write=False)
    completion = attrs.evolve(COMPLETION, tokens=view)
    tokens[0] = 99
    assert completion.tokens[0] == 5


def test_records_compare_by_array_values():
    assert COMPLETION == Completion(
        tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], text="567", stop_reason="stop"
    )
    assert COMPLETION != attrs.evolve(COMPLETION, tokens=[5, 6, 8])


@given(completion=completions())
def test_is_truncated_means_the_sampler_hit_its_length_limit(completion):
    assert completion.is_truncated == (completion.stop_reason == "length")


@given(rewards=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=6))
def test_a_group_is_degenerate_exactly_when_all_rewards_are_equal(rewards):
    group = ScoredGroup(
        prompt_tokens=[1],
        completions=[COMPLETION] * len(rewards),
        rewards=rewards,
        advantages=[0.0] * len(rewards),
    )
    assert group.is_degenerate == (len(set(rewards)) == 1)
    assert group.group_size == len(rewards)


@given(group=scored_groups())
def test_scored_groups_from_the_strategy_are_valid_and_survive_evolve(group):
    assert attrs.evolve(group) == group


def test_token_batch_counts_sequences_tokens_and_train_tokens():
    assert (BATCH.num_sequences, BATCH.num_tokens, BATCH.num_train_tokens) == (2, 5, 4)
    assert BATCH.offsets.tolist() == [0, 3, 5]


def test_token_batch_sequences_are_views_of_the_packed_arrays():
    first, second = BATCH.sequences()
    assert first.input_tokens.tolist() == [1, 2, 5] and second.target_tokens.tolist() == [4, 8]
    assert np.shares_memory(second.advantages, BATCH.advantages)
    assert not second.advantages.flags.writeable


def test_group_advantages_split_into_groups():
    result = GroupAdvantages(
        advantages=[0.5, -0.5, 0.0], group_sizes=[2, 1], degenerate=[False, True]
    )
    assert [part.tolist() for part in result.split()] == [[0.5, -0.5], [0.0]]
