"""Tests for grpo.core.alignment: docs/FORMULAS.md "Token alignment", packing and its fast path."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.alignment import PAD_TOKEN_ID, align, pack, pack_groups
from tests.strategies import completions, logprob_arrays, scored_groups, token_arrays


@st.composite
def alignment_inputs(draw):
    prompt = draw(token_arrays(1, 10))
    completion = draw(token_arrays(1, 10))
    logprobs = draw(logprob_arrays(completion.size))
    advantage = draw(st.floats(-5.0, 5.0, allow_nan=False))
    return prompt, completion, logprobs, advantage


@given(inputs=alignment_inputs())
def test_aligned_arrays_have_prompt_plus_completion_minus_one_positions(inputs):
    prompt, completion, logprobs, advantage = inputs
    aligned = align(prompt, completion, logprobs, advantage)
    expected = prompt.size + completion.size - 1
    for name in ("input_tokens", "target_tokens", "sampling_logprobs", "advantages", "mask"):
        assert getattr(aligned, name).shape == (expected,), name


@given(inputs=alignment_inputs())
def test_input_position_k_predicts_target_k(inputs):
    prompt, completion, logprobs, advantage = inputs
    aligned = align(prompt, completion, logprobs, advantage)
    full = np.concatenate((prompt, completion))
    np.testing.assert_array_equal(aligned.input_tokens, full[:-1])
    trained = aligned.mask == 1
    # Where the target trains, it is the token that follows input k in the full sequence.
    np.testing.assert_array_equal(aligned.target_tokens[trained], full[1:][trained])
    np.testing.assert_array_equal(aligned.target_tokens[trained], completion)


@given(inputs=alignment_inputs())
def test_prompt_positions_are_padded_and_masked_and_completion_positions_train(inputs):
    prompt, completion, logprobs, advantage = inputs
    aligned = align(prompt, completion, logprobs, advantage)
    pad = prompt.size - 1
    np.testing.assert_array_equal(aligned.mask, np.r_[np.zeros(pad), np.ones(completion.size)])
    np.testing.assert_array_equal(aligned.target_tokens[:pad], np.full(pad, PAD_TOKEN_ID))
    np.testing.assert_array_equal(aligned.sampling_logprobs, np.r_[np.zeros(pad), logprobs])
    np.testing.assert_array_equal(
        aligned.advantages, np.r_[np.zeros(pad), np.full(completion.size, advantage)]
    )


def test_align_of_a_small_example():
    aligned = align([11, 12, 13], [21, 22], [-0.5, -0.25], 2.0)
    assert aligned.input_tokens.tolist() == [11, 12, 13, 21]
    assert aligned.target_tokens.tolist() == [PAD_TOKEN_ID, PAD_TOKEN_ID, 21, 22]
    assert aligned.sampling_logprobs.tolist() == [0.0, 0.0, -0.5, -0.25]
    assert aligned.advantages.tolist() == [0.0, 0.0, 2.0, 2.0]
    assert aligned.mask.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_a_one_token_prompt_needs_no_padding():
    aligned = align([7], [8, 9], [-1.0, -2.0], 1.0)
    assert aligned.input_tokens.tolist() == [7, 8]
    assert aligned.target_tokens.tolist() == [8, 9]
    assert aligned.mask.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt_tokens=[]), "prompt_tokens is empty: .*encode the prompt"),
        (
            dict(completion_tokens=[], completion_logprobs=[]),
            "completion_tokens is empty: .*raise max_tokens",
        ),
        (
            dict(completion_logprobs=[-1.0]),
            "completion_logprobs has 1 entries but completion_tokens has 2",
        ),
        (
            dict(completion_logprobs=[-1.0, float("nan")]),
            r"completion_logprobs\[1\] = nan is not finite",
        ),
        (
            dict(completion_logprobs=[float("-inf"), -1.0]),
            r"completion_logprobs\[0\] = -inf is not finite",
        ),
        (dict(advantage=float("inf")), "advantage = inf is not finite"),
        (
            dict(prompt_tokens=[1.0, 2.5]),
            "prompt_tokens must hold integer token ids, got dtype float64",
        ),
        (
            dict(completion_tokens=[[5, 6]]),
            r"completion_tokens must be a 1-D array of token ids, got shape \(1, 2\)",
        ),
        (dict(prompt_tokens=[-1, 2]), "input_tokens has a negative token id -1 at index 0"),
    ],
)
def test_bad_alignment_inputs_are_rejected_naming_the_field(kwargs, message):
    arguments = dict(
        prompt_tokens=[1, 2],
        completion_tokens=[5, 6],
        completion_logprobs=[-1.0, -1.0],
        advantage=0.5,
    )
    arguments.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        align(**arguments)


@given(sequences=st.lists(alignment_inputs(), max_size=5))
def test_pack_concatenates_sequences_and_splits_back_into_them(sequences):
    aligned = [align(*inputs) for inputs in sequences]
    batch = pack(aligned)
    assert batch.seq_lens.tolist() == [len(sequence) for sequence in aligned]
    assert batch.num_tokens == sum(len(sequence) for sequence in aligned)
    assert batch.num_train_tokens == sum(completion.size for _, completion, _, _ in sequences)
    assert batch.sequences() == tuple(aligned)


@pytest.mark.parametrize("drop_degenerate", [True, False])
@given(groups=st.lists(scored_groups(), max_size=5))
def test_pack_groups_equals_pack_of_align_of_every_completion(groups, drop_degenerate):
    expected = pack(
        [
            align(group.prompt_tokens, completion.tokens, completion.logprobs, advantage)
            for group in groups
            if not (drop_degenerate and group.is_degenerate)
            for completion, advantage in zip(group.completions, group.advantages)
        ]
    )
    assert pack_groups(groups, drop_degenerate=drop_degenerate) == expected


@given(groups=st.lists(scored_groups(), min_size=1, max_size=5))
def test_pack_groups_drops_exactly_the_degenerate_groups(groups):
    batch = pack_groups(groups)
    assert batch.num_sequences == sum(
        group.group_size for group in groups if not group.is_degenerate
    )
    assert pack_groups(groups, drop_degenerate=False).num_sequences == sum(
        group.group_size for group in groups
    )


@given(group=scored_groups(), completion=completions())
def test_pack_groups_keeps_each_groups_own_prompt(group, completion):
    other = attrs.evolve(
        group,
        prompt_tokens=group.prompt_tokens[::-1] + 1,
        completions=(completion,),
        rewards=[0.0],
        advantages=[0.0],
    )
    sequences = pack_groups([group, other], drop_degenerate=False).sequences()
    assert (
        sequences[-1].input_tokens[: other.prompt_tokens.size].tolist()
        == other.prompt_tokens.tolist()
    )
    assert (
        sequences[0].input_tokens[: group.prompt_tokens.size].tolist()
        == group.prompt_tokens.tolist()
    )


def test_packing_nothing_gives_an_empty_batch():
    assert pack([]).num_sequences == 0
    assert pack_groups([]).num_tokens == 0
    assert pack_groups([]) == pack([])


# --- --mask-truncated ---------------------------------------------------------------------


@given(groups=st.lists(scored_groups(), min_size=1, max_size=5))
def test_mask_truncated_changes_only_the_truncated_completions_tokens(groups):
    from grpo.core.alignment import mask_sequences, truncated_sequences

    batch = pack_groups(groups, drop_degenerate=False)
    truncated_S = truncated_sequences(groups)
    masked = mask_sequences(batch, truncated_S)
    flags = [c.is_truncated for group in groups for c in group.completions]
    assert truncated_S.tolist() == flags
    for before, after, truncated in zip(batch.sequences(), masked.sequences(), flags):
        if truncated:
            assert not after.mask.any() and not after.advantages.any()
            assert np.array_equal(after.input_tokens, before.input_tokens)
            assert np.array_equal(after.sampling_logprobs, before.sampling_logprobs)
        else:
            assert after == before
    assert np.array_equal(masked.seq_lens, batch.seq_lens)
    assert masked.num_train_tokens == batch.num_train_tokens - sum(
        c.tokens.size for group in groups for c in group.completions if c.is_truncated
    )


def test_mask_sequences_needs_one_flag_per_sequence():
    from grpo.core.alignment import mask_sequences

    batch = pack([align([1, 2], [3, 4], [-0.1, -0.2], 1.0)])
    with pytest.raises(ValueError, match="one flag per packed sequence"):
        mask_sequences(batch, [True, False])
