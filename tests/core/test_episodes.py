"""Tests for grpo.core.episodes: docs/FORMULAS.md "Multi-turn episodes" (masking, alignment)."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.alignment import PAD_TOKEN_ID, align
from grpo.core.episodes import (
    Episode,
    EpisodeGroup,
    Turn,
    align_episode,
    completion_episode,
    episode_groups,
    episode_metrics,
    pack_episode_groups,
    pack_rollout_groups,
    sampled_sequences,
    truncated_episodes,
    truncated_rollouts,
)
from tests.strategies import scored_groups

# Sampled tokens get ids >= SAMPLED_BASE, each one distinct, and log-prob -(id - base + 1)/64,
# so a test can tell every sampled token (and its log-prob) apart from every other token.
SAMPLED_BASE = 10_000


@st.composite
def episodes(draw, max_turns: int = 5, max_len: int = 6):
    """A random turn structure: 1..max_turns turns, observations of 0..max_len tokens (the
    first at least 1), actions of 1..max_len distinct sampled tokens."""
    num_turns = draw(st.integers(1, max_turns))
    turns, next_sampled = [], SAMPLED_BASE
    for index in range(num_turns):
        observation = draw(
            st.lists(st.integers(0, 999), min_size=int(index == 0), max_size=max_len)
        )
        size = draw(st.integers(1, max_len))
        action = np.arange(next_sampled, next_sampled + size)
        next_sampled += size
        turns.append(
            Turn(
                observation_tokens=np.array(observation, dtype=np.int64),
                action_tokens=action,
                action_logprobs=-(action - SAMPLED_BASE + 1) / 64.0,
                reward=draw(st.sampled_from([0.0, 0.5, 1.0])),
                stop_reason=draw(st.sampled_from(["stop", "length"])),
            )
        )
    return Episode(turns=turns, final_reward=draw(st.sampled_from([0.0, 1.0])))


advantages = st.floats(-4.0, 4.0, allow_nan=False).filter(lambda a: a != 0.0)


@given(episode=episodes(), advantage=advantages)
def test_every_sampled_token_is_a_target_exactly_once_with_its_own_logprob(episode, advantage):
    aligned = align_episode(episode, advantage)
    trained = aligned.mask == 1
    sampled = np.concatenate([turn.action_tokens for turn in episode.turns])
    logprobs = np.concatenate([turn.action_logprobs for turn in episode.turns])
    # In order, once each: the trained targets are the sampled tokens, nothing else.
    np.testing.assert_array_equal(aligned.target_tokens[trained], sampled)
    np.testing.assert_array_equal(aligned.sampling_logprobs[trained], logprobs)
    np.testing.assert_array_equal(aligned.advantages[trained], np.full(sampled.size, advantage))


@given(episode=episodes(), advantage=advantages)
def test_no_observation_token_has_a_target_logprob_or_advantage(episode, advantage):
    aligned = align_episode(episode, advantage)
    untrained = aligned.mask == 0
    assert (aligned.target_tokens[untrained] == PAD_TOKEN_ID).all()
    assert (aligned.sampling_logprobs[untrained] == 0).all()
    assert (aligned.advantages[untrained] == 0).all()
    # The positions whose next token is an observation token are exactly the untrained ones.
    observed_next = ~episode.sampled[1:]
    np.testing.assert_array_equal(untrained, observed_next)
    assert int(aligned.mask.sum()) == episode.num_sampled


@given(episode=episodes(), advantage=advantages)
def test_input_position_k_predicts_the_next_token_of_the_stream(episode, advantage):
    aligned = align_episode(episode, advantage)
    stream = episode.tokens
    np.testing.assert_array_equal(aligned.input_tokens, stream[:-1])
    trained = aligned.mask == 1
    np.testing.assert_array_equal(aligned.target_tokens[trained], stream[1:][trained])
    assert len(aligned) == stream.size - 1


@given(episode=episodes(max_turns=1), advantage=advantages)
def test_one_turn_episode_aligns_as_a_prompt_and_its_completion(episode, advantage):
    (turn,) = episode.turns
    expected = align(turn.observation_tokens, turn.action_tokens, turn.action_logprobs, advantage)
    assert align_episode(episode, advantage) == expected


@given(episodes_G=st.lists(episodes(max_turns=3), min_size=2, max_size=4))
def test_packed_episode_groups_train_every_sampled_token_of_nondegenerate_groups(episodes_G):
    (group,) = episode_groups([episodes_G], "center")
    batch = pack_episode_groups([group])
    if group.is_degenerate:
        assert batch.num_sequences == 0
        return
    assert batch.num_sequences == len(episodes_G)
    assert batch.num_train_tokens == sum(e.num_sampled for e in episodes_G)
    np.testing.assert_allclose(group.advantages, group.rewards - group.rewards.mean())
    for sequence, episode, advantage in zip(batch.sequences(), episodes_G, group.advantages):
        assert sequence == align_episode(episode, advantage)


def test_episode_return_is_the_sum_of_turn_rewards_plus_the_final_reward():
    turns = [
        Turn(observation_tokens=[1, 2], action_tokens=[3], action_logprobs=[-0.1], reward=0.25),
        Turn(observation_tokens=[4], action_tokens=[5, 6], action_logprobs=[-0.2, -0.3], reward=1),
    ]
    episode = Episode(turns=turns, final_reward=1.0)
    assert episode.reward == 2.25
    assert episode.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert episode.sampled.tolist() == [False, False, True, False, True, True]
    aligned = align_episode(episode, 2.0)
    assert aligned.input_tokens.tolist() == [1, 2, 3, 4, 5]
    assert aligned.target_tokens.tolist() == [PAD_TOKEN_ID, 3, PAD_TOKEN_ID, 5, 6]
    assert aligned.sampling_logprobs.tolist() == [0.0, -0.1, 0.0, -0.2, -0.3]
    assert aligned.advantages.tolist() == [0.0, 2.0, 0.0, 2.0, 2.0]
    assert aligned.mask.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]


def test_a_turn_may_follow_the_previous_action_with_no_observation_tokens():
    turns = [
        Turn(observation_tokens=[1], action_tokens=[3], action_logprobs=[-0.1]),
        Turn(observation_tokens=[], action_tokens=[5], action_logprobs=[-0.2]),
    ]
    aligned = align_episode(Episode(turns=turns), 1.0)
    assert aligned.target_tokens.tolist() == [3, 5]
    assert aligned.mask.tolist() == [1.0, 1.0]


def _turn(**changes):
    fields = {"observation_tokens": [1], "action_tokens": [2], "action_logprobs": [-0.5]}
    return Turn(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"action_tokens": [], "action_logprobs": []}, "action_tokens is empty"),
        ({"action_logprobs": [-0.5, -0.5]}, "action_logprobs has 2 entries"),
        ({"action_logprobs": [0.5]}, "positive value"),
        ({"action_logprobs": [float("nan")]}, "non-finite"),
        ({"reward": float("inf")}, "reward = inf is not finite"),
        ({"observation_tokens": [-1]}, "negative token id"),
        ({"stop_reason": "eos"}, "stop_reason"),
        ({"tool_calls": 1, "tool_errors": 2}, "tool_errors = 2 exceeds"),
    ],
)
def test_invalid_turns_cannot_exist(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _turn(**changes)


def test_invalid_episodes_and_groups_cannot_exist():
    with pytest.raises(ValueError, match="turns is empty"):
        Episode(turns=[])
    with pytest.raises(ValueError, match="observation_tokens is empty"):
        Episode(turns=[_turn(observation_tokens=[])])
    with pytest.raises(ValueError, match="advantages has 1 entries but the group has 2"):
        EpisodeGroup(episodes=[Episode(turns=[_turn()])] * 2, advantages=[0.0])
    with pytest.raises(ValueError, match="not finite"):
        align_episode(Episode(turns=[_turn()]), float("nan"))
    episode = Episode(turns=[_turn()])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        episode.final_reward = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        episode.tokens[0] = 5


def test_episode_metrics_and_truncation_flags():
    calls = _turn(tool_calls=2, tool_errors=1, reward=0.5)
    long = _turn(stop_reason="length")
    groups = episode_groups(
        [[Episode(turns=[calls, _turn()], final_reward=1.0), Episode(turns=[long])]], "center"
    )
    metrics = episode_metrics(groups)
    assert metrics["reward"] == 0.75
    assert metrics["env/turns"] == 1.5
    assert metrics["env/tool_calls"] == 1.0
    assert metrics["env/tool_errors"] == 0.5
    assert metrics["env/tool_use"] == 0.5
    assert metrics["rollout/frac_truncated"] == 0.5
    assert metrics["frac_degenerate"] == 0.0
    assert truncated_episodes(groups).tolist() == [False, True]


def _fields(batch):
    return [
        batch.input_tokens,
        batch.target_tokens,
        batch.sampling_logprobs,
        batch.advantages,
        batch.mask,
        batch.seq_lens,
    ]


def _one_turn_groups(groups):
    return [
        EpisodeGroup(
            episodes=[
                completion_episode(g.prompt_tokens, c, r)
                for c, r in zip(g.completions, g.rewards, strict=True)
            ],
            advantages=g.advantages,
        )
        for g in groups
    ]


@given(groups=st.lists(scored_groups(), max_size=4), drop=st.booleans())
def test_completions_pack_as_their_one_turn_episodes(groups, drop):
    fast = pack_rollout_groups(groups, drop_degenerate=drop)
    as_episodes = pack_episode_groups(_one_turn_groups(groups), drop_degenerate=drop)
    for left, right in zip(_fields(fast), _fields(as_episodes), strict=True):
        np.testing.assert_array_equal(left, right)
    assert (
        truncated_rollouts(groups).tolist() == truncated_episodes(_one_turn_groups(groups)).tolist()
    )


@given(
    groups=st.lists(scored_groups(), min_size=1, max_size=3),
    episodes_G=st.lists(episodes(), min_size=1, max_size=3),
)
def test_a_mixed_batch_packs_completions_as_one_turn_episodes(groups, episodes_G):
    episode_group = EpisodeGroup(episodes=episodes_G, advantages=np.ones(len(episodes_G)))
    mixed = pack_rollout_groups([*groups, episode_group], drop_degenerate=False)
    expected = pack_episode_groups(
        [*_one_turn_groups(groups), episode_group], drop_degenerate=False
    )
    for left, right in zip(_fields(mixed), _fields(expected), strict=True):
        np.testing.assert_array_equal(left, right)


@given(groups=st.lists(scored_groups(), min_size=1, max_size=3))
def test_sampled_sequences_of_completions_read_the_completion_after_its_prompt(groups):
    found = sampled_sequences(groups)
    same = sampled_sequences(_one_turn_groups(groups))
    members = [(g, c) for g in groups for c in g.completions]
    assert len(found) == len(members) == len(same)
    for (tokens, positions), (group, completion), (tokens_e, positions_e) in zip(
        found, members, same, strict=True
    ):
        np.testing.assert_array_equal(tokens[positions], completion.tokens)
        np.testing.assert_array_equal(tokens[: group.prompt_tokens.size], group.prompt_tokens)
        np.testing.assert_array_equal(tokens, tokens_e)
        np.testing.assert_array_equal(positions, positions_e)
