"""Multi-turn episodes: immutable records and their next-token training arrays.

An episode is the token stream o_0 a_0 o_1 a_1 ... o_{n-1} a_{n-1}: observation tokens o_t
(the prompt, then what the environment or a tool answered, with the chat template's turn
markers) that the policy only reads, and action tokens a_t that the sampler produced, with
its log-prob of each. docs/FORMULAS.md "Multi-turn episodes" states the alignment:

- input_tokens      = X[:-1]                  (X the whole stream, length n_X)
- target_tokens[k]  = X[k+1] if X[k+1] was sampled, else pad
- sampling_logprobs = lp(X[k+1]) at sampled targets, else 0
- advantages        = A at sampled targets, else 0 (A: the episode's group advantage)
- mask              = 1 at sampled targets, else 0

so every sampled token is a target exactly once, with its own log-prob, and no observation
token ever has a target, a log-prob or an advantage. One turn is `align` of
`grpo.core.alignment` exactly.

- `Turn`, `Episode`, `EpisodeGroup`: the records (an episode's return is Σ per-turn rewards
  plus its final reward).
- `episode_groups`: episodes of each task with their group advantages.
- `align_episode`, `pack_episode_groups`: episodes -> `AlignedSequence` / `TokenBatch`.
- `truncated_episodes`, `episode_metrics`: overlong flags and the rollout metrics.
- `RolloutGroup`: a group of either kind, of which a completion is the one-turn case
  (`completion_episode`); `pack_rollout_groups`, `truncated_rollouts` and
  `sampled_sequences` take either, so the shell has one packer and one scoring path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from grpo.core.advantages import group_advantages
from grpo.core.alignment import PAD_TOKEN_ID, pack, pack_groups
from grpo.core.records import (
    AlignedSequence,
    Completion,
    ScoredGroup,
    TokenBatch,
    _array_field,
    _require_finite,
    _require_sampled,
    _require_token_ids,
    _to_float64,
    _to_int64,
)

__all__ = [
    "Episode",
    "EpisodeGroup",
    "RolloutGroup",
    "Turn",
    "align_episode",
    "completion_episode",
    "episode_groups",
    "episode_metrics",
    "pack_episode_groups",
    "pack_rollout_groups",
    "sampled_sequences",
    "truncated_episodes",
    "truncated_rollouts",
]

STOP_REASONS = ("stop", "length", "context", "env_error")
"""How a turn ended: an end-of-turn token, --max-tokens, or the model's context limit."""


def _finite_float(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not np.isfinite(value):
        raise ValueError(f"{attribute.name} = {value!r} is not finite; rewards must be finite")


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} = {value} must be >= 0 (a count)")


@attrs.frozen
class Turn:
    """One turn: the observation tokens the policy read, then the action tokens it sampled.

    ``reward`` is what the environment's step gave for this action; ``tool_calls`` and
    ``tool_errors`` count the action's tool calls and those answered with an error.
    """

    observation_tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    action_tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    action_logprobs: npt.NDArray[np.float64] = _array_field(_to_float64)
    reward: float = attrs.field(default=0.0, converter=float, validator=_finite_float)
    action_text: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    stop_reason: str = attrs.field(default="stop", validator=attrs.validators.in_(STOP_REASONS))
    tool_calls: int = attrs.field(default=0, converter=int, validator=_non_negative)
    tool_errors: int = attrs.field(default=0, converter=int, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        _require_token_ids("observation_tokens", self.observation_tokens)
        _require_sampled(
            ("action_tokens", self.action_tokens),
            ("action_logprobs", self.action_logprobs),
            "action_tokens is empty: the sampler returned no tokens for this turn; end the "
            "episode before it or raise --max-tokens",
        )
        if self.tool_errors > self.tool_calls:
            raise ValueError(
                f"tool_errors = {self.tool_errors} exceeds tool_calls = {self.tool_calls}"
            )


def _to_tuple(value: object) -> tuple[Any, ...]:
    return tuple(value)  # type: ignore[arg-type]


def _require_items(
    value: tuple[Any, ...], name: str, kind: type, article: str, at_least_one: str
) -> None:
    """ValueError when ``value`` is empty, TypeError naming the first item not a ``kind``."""
    if not value:
        raise ValueError(f"{name} is empty: {at_least_one}")
    for index, item in enumerate(value):
        if not isinstance(item, kind):
            raise TypeError(
                f"{name}[{index}] is a {type(item).__name__}, not {article} {kind.__name__}"
            )


def _check_turns(instance: object, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    _require_items(value, "turns", Turn, "a", "an episode has at least one sampled turn")
    if value[0].observation_tokens.size == 0:
        raise ValueError(
            "turns[0].observation_tokens is empty: the first sampled token needs a prompt token "
            "to be predicted from; encode the initial observation first"
        )


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@attrs.frozen
class Episode:
    """One episode: its turns in order and a final reward; the return is Σ rewards + final."""

    turns: tuple[Turn, ...] = attrs.field(converter=_to_tuple, validator=_check_turns)
    final_reward: float = attrs.field(default=0.0, converter=float, validator=_finite_float)

    @property
    def reward(self) -> float:
        """R = Σ_t r_t + r_final, the episode's return (what the group advantage compares)."""
        return float(sum(turn.reward for turn in self.turns) + self.final_reward)

    @property
    def num_turns(self) -> int:
        """Turns the policy sampled."""
        return len(self.turns)

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """X = o_0 a_0 o_1 a_1 ...: every token of the episode, in order."""
        pieces = [p for t in self.turns for p in (t.observation_tokens, t.action_tokens)]
        return _frozen(np.concatenate(pieces))

    @property
    def sampled(self) -> npt.NDArray[np.bool_]:
        """One flag per token of `tokens`: True where the policy sampled it."""
        pieces = [
            np.repeat([False, True], [t.observation_tokens.size, t.action_tokens.size])
            for t in self.turns
        ]
        return _frozen(np.concatenate(pieces))

    @property
    def logprobs(self) -> npt.NDArray[np.float64]:
        """The sampler's log-prob of every sampled token of `tokens`, 0 at observations."""
        pieces = [
            p for t in self.turns for p in (np.zeros(t.observation_tokens.size), t.action_logprobs)
        ]
        return _frozen(np.concatenate(pieces))

    @property
    def num_sampled(self) -> int:
        """Σ_t |a_t|: the tokens that train."""
        return int(sum(turn.action_tokens.size for turn in self.turns))

    @property
    def is_truncated(self) -> bool:
        """True when the last turn stopped at --max-tokens or at the context limit."""
        return self.turns[-1].stop_reason in ("length", "context")


def _check_episodes(instance: object, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    _require_items(value, "episodes", Episode, "an", "a group needs at least one episode")


@attrs.frozen
class EpisodeGroup:
    """The G episodes of one task and their group advantages A_G (rewards R_G = returns)."""

    episodes: tuple[Episode, ...] = attrs.field(converter=_to_tuple, validator=_check_episodes)
    advantages: npt.NDArray[np.float64] = _array_field(_to_float64)

    def __attrs_post_init__(self) -> None:
        if self.advantages.size != len(self.episodes):
            raise ValueError(
                f"advantages has {self.advantages.size} entries but the group has "
                f"{len(self.episodes)} episodes; pass one advantage per episode"
            )
        _require_finite("advantages", self.advantages, "every episode needs a finite advantage")

    @property
    def rewards(self) -> npt.NDArray[np.float64]:
        """R_G: each episode's return."""
        return np.array([episode.reward for episode in self.episodes], dtype=np.float64)

    @property
    def group_size(self) -> int:
        """G, the number of episodes of the task."""
        return len(self.episodes)

    @property
    def is_degenerate(self) -> bool:
        """True when all returns are equal: the group has no learning signal."""
        rewards = self.rewards
        return bool(np.all(rewards == rewards[0]))


def episode_groups(episodes_P: Sequence[Sequence[Episode]], method: str) -> list[EpisodeGroup]:
    """Every task's episodes with group advantages of their returns (grpo.core.advantages)."""
    rewards_P = [np.array([e.reward for e in group], dtype=np.float64) for group in episodes_P]
    sizes_P = np.array([rewards.size for rewards in rewards_P], dtype=np.int64)
    result = group_advantages(np.concatenate(rewards_P), sizes_P, method)
    advantages_P = np.split(result.advantages, np.cumsum(sizes_P)[:-1])
    return [
        EpisodeGroup(episodes=tuple(episodes), advantages=advantages)
        for episodes, advantages in zip(episodes_P, advantages_P, strict=True)
    ]


def align_episode(episode: Episode, advantage: float) -> AlignedSequence:
    """Next-token arrays of X = o_0 a_0 ... a_{n-1}: targets, log-probs, A and mask 1 exactly
    at the positions whose next token was sampled; observation targets are pad, 0, 0, 0."""
    advantage = float(advantage)
    if not np.isfinite(advantage):
        raise ValueError(f"advantage = {advantage!r} is not finite; compute it from finite rewards")
    tokens_T, sampled_T, logprobs_T = episode.tokens, episode.sampled, episode.logprobs
    trains = sampled_T[1:]
    return AlignedSequence(
        input_tokens=tokens_T[:-1],
        target_tokens=np.where(trains, tokens_T[1:], PAD_TOKEN_ID),
        sampling_logprobs=np.where(trains, logprobs_T[1:], 0.0),
        advantages=np.where(trains, advantage, 0.0),
        mask=trains.astype(np.float64),
    )


def pack_episode_groups(
    groups: Sequence[EpisodeGroup], *, drop_degenerate: bool = True
) -> TokenBatch:
    """`pack` of `align_episode` of every episode, group by group (degenerate groups skipped
    when drop_degenerate is true)."""
    return pack(
        [
            align_episode(episode, advantage)
            for group in groups
            if not (drop_degenerate and group.is_degenerate)
            for episode, advantage in zip(group.episodes, group.advantages, strict=True)
        ]
    )


def truncated_episodes(groups: Sequence[EpisodeGroup]) -> npt.NDArray[np.bool_]:
    """One flag per episode, in packing order: True when its last turn hit a token limit."""
    return np.array(
        [episode.is_truncated for group in groups for episode in group.episodes], dtype=bool
    )


def episode_metrics(groups: Sequence[EpisodeGroup]) -> dict[str, float]:
    """Mean return, frac_degenerate, sampled tokens per episode, turns, tool calls and errors,
    the share of episodes that call a tool, mean per-turn reward, frac_truncated, and the
    share of episodes ended by an environment error (``env/errors``, --env-errors zero)."""
    if not groups:
        raise ValueError("episode_metrics needs at least one group; got none")
    episodes = [episode for group in groups for episode in group.episodes]
    turns = [turn for episode in episodes for turn in episode.turns]
    sampled = np.array([episode.num_sampled for episode in episodes], dtype=np.float64)
    return {
        "reward": float(np.concatenate([group.rewards for group in groups]).mean()),
        "frac_degenerate": float(np.mean([group.is_degenerate for group in groups])),
        "rollout/avg_gen_len": float(sampled.mean()),
        "rollout/max_gen_len": float(sampled.max()),
        "rollout/frac_truncated": float(np.mean([e.is_truncated for e in episodes])),
        "num_groups": float(len(groups)),
        "num_completions": float(len(episodes)),
        "env/turns": float(np.mean([episode.num_turns for episode in episodes])),
        "env/tool_calls": float(np.mean([sum(t.tool_calls for t in e.turns) for e in episodes])),
        "env/tool_errors": float(np.mean([sum(t.tool_errors for t in e.turns) for e in episodes])),
        "env/tool_use": float(np.mean([any(t.tool_calls for t in e.turns) for e in episodes])),
        "env/turn_reward": float(np.mean([turn.reward for turn in turns])),
        "env/final_reward": float(np.mean([episode.final_reward for episode in episodes])),
        "env/errors": float(np.mean([e.turns[-1].stop_reason == "env_error" for e in episodes])),
    }


RolloutGroup = ScoredGroup | EpisodeGroup
"""The G rollouts of one prompt: completions (`ScoredGroup`, the one-turn case, packed by a
vectorized fast path) or episodes (`EpisodeGroup`)."""


def completion_episode(
    prompt_tokens: npt.ArrayLike, completion: Completion, reward: float = 0.0
) -> Episode:
    """The one-turn episode a completion is: the prompt observed, the completion sampled and
    rewarded ``reward`` (a stop reason other than "length" is an end of turn, "stop")."""
    return Episode(
        turns=(
            Turn(
                observation_tokens=prompt_tokens,
                action_tokens=completion.tokens,
                action_logprobs=completion.logprobs,
                reward=reward,
                action_text=completion.text,
                stop_reason="length" if completion.is_truncated else "stop",
            ),
        )
    )


def _as_episode_groups(groups: Sequence[RolloutGroup]) -> list[EpisodeGroup]:
    return [
        group
        if isinstance(group, EpisodeGroup)
        else EpisodeGroup(
            episodes=[
                completion_episode(group.prompt_tokens, completion, reward)
                for completion, reward in zip(group.completions, group.rewards, strict=True)
            ],
            advantages=group.advantages,
        )
        for group in groups
    ]


def pack_rollout_groups(
    groups: Sequence[RolloutGroup], *, drop_degenerate: bool = True
) -> TokenBatch:
    """The one packer: every member of every group aligned and packed, group by group.

    Groups of completions only take `pack_groups`' vectorized path, which equals
    `pack_episode_groups` of their one-turn episodes; any episode sends the batch through
    `pack_episode_groups` (completions as their one-turn episodes).
    """
    if all(isinstance(group, ScoredGroup) for group in groups):
        return pack_groups(groups, drop_degenerate=drop_degenerate)  # type: ignore[arg-type]
    return pack_episode_groups(_as_episode_groups(groups), drop_degenerate=drop_degenerate)


def truncated_rollouts(groups: Sequence[RolloutGroup]) -> npt.NDArray[np.bool_]:
    """One flag per member, in packing order: True when it stopped at a token limit."""
    return np.array(
        [
            member.is_truncated
            for group in groups
            for member in (group.completions if isinstance(group, ScoredGroup) else group.episodes)
        ],
        dtype=bool,
    )


def sampled_sequences(
    groups: Sequence[RolloutGroup],
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """(tokens X, positions of the sampled tokens in X) of every member, in packing order:
    prompt + completion read at the completion, an episode's stream at its actions."""
    found = []
    for group in groups:
        if isinstance(group, ScoredGroup):
            for completion in group.completions:
                tokens = np.concatenate([group.prompt_tokens, completion.tokens])
                found.append((tokens, np.arange(group.prompt_tokens.size, tokens.size)))
        else:
            for episode in group.episodes:
                found.append((episode.tokens, np.flatnonzero(episode.sampled)))
    return found
