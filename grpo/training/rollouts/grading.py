"""Grading a step's groups: --reward scores, group advantages, dynamic sampling's refill.

A ``Job`` is a step's sampling in flight; its result, graded, is a `StepRollouts`
(completions and their --reward scores) or a `PlayedGroups` (episodes, whose returns are
the environment's): what a step sampled, round after round under
--dynamic-sampling (`refill`). `graded_step` gives the step's groups their advantages and
keeps the groups that train (`trainable_groups`), in one `GradedStep`.
Suffixes name axes (docs/DESIGN.md): ``_P`` one per problem of a step, ``_C`` one per
completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, Self, TypeAlias, TypeVar

import attrs
import numpy as np

from grpo.core.advantages import degenerate_groups, group_advantages
from grpo.core.episodes import Episode, RolloutGroup, episode_groups, episode_metrics
from grpo.core.metrics import rollout_metrics
from grpo.core.records import Completion, ScoredGroup
from grpo.core.rewards import RewardInput
from grpo.core.usage import TokenUsage
from grpo.rewards import RewardFn
from grpo.rewards.calls import active_caller
from grpo.rewards.scores import RewardScores, score_completions
from grpo.training.rollouts.problems import Problem
from grpo.training.settings.config import TrainConfig


class Rounds(Protocol):
    """What `refill` needs of a step's sampled groups (`StepRollouts`; under --env the
    episodes' `PlayedGroups`)."""

    @property
    def rounds(self) -> int: ...

    def num_nondegenerate(self) -> int: ...

    def extended(self, more: Self) -> Self: ...


class Group(Protocol):
    """What `trainable_groups` needs of a group (`ScoredGroup`, `EpisodeGroup`)."""

    @property
    def is_degenerate(self) -> bool: ...


JobResult: TypeAlias = "list[list[Completion]] | PlayedGroups"
"""What a finished job holds: the completions of every problem, or the played episodes."""


class Job(Protocol):
    """One step's sampling in flight: its problems, the weights' version it samples, its
    result (completions per problem, or played episodes) and usage."""

    @property
    def sampler_version(self) -> int: ...

    @property
    def problems(self) -> Sequence[Problem]: ...

    def result(self) -> JobResult: ...

    def usage(self) -> TokenUsage: ...

    def cancel(self) -> None: ...


RoundsT = TypeVar("RoundsT", bound=Rounds)
GroupT = TypeVar("GroupT", bound=Group)


def reward_groups(
    problems_P: Sequence[Problem],
    completions_P: Sequence[Sequence[Completion]],
    rewards: Sequence[RewardFn],
    *,
    max_tokens: int,
    overlong_buffer: int,
    on_error: str,
    workers: int,
    timeout: float = 0.0,
) -> RewardScores:
    """Every --reward of every completion (see `grpo.rewards.scores.score_completions`), called by
    the run's reward caller when one is active (`grpo.rewards.calls.reward_session`)."""
    items = [
        (
            completion.text,
            problem.row,
            RewardInput(
                index=problem.index,
                gold=problem.gold,
                num_tokens=int(completion.tokens.size),
                max_tokens=max_tokens,
                stop_reason=completion.stop_reason,
                overlong_buffer=overlong_buffer,
            ),
        )
        for problem, completions in zip(problems_P, completions_P, strict=True)
        for completion in completions
    ]
    return score_completions(
        rewards,
        items,
        [len(completions) for completions in completions_P],
        on_error=on_error,
        workers=workers,
        timeout=timeout,
        caller=active_caller(),
    )


def score_groups(
    problems_P: Sequence[Problem],
    completions_P: Sequence[Sequence[Completion]],
    rewards_P: Sequence[np.ndarray],
    method: str,
) -> list[ScoredGroup]:
    """Every group with its group-relative advantages (one vectorized call for the batch)."""
    group_sizes_P = np.array([len(rewards) for rewards in rewards_P], dtype=np.int64)
    result = group_advantages(np.concatenate(rewards_P), group_sizes_P, method)
    advantages_P = np.split(result.advantages, np.cumsum(group_sizes_P)[:-1])
    return [
        ScoredGroup(
            prompt_tokens=problem.prompt_tokens,
            completions=tuple(completions),
            rewards=rewards,
            advantages=advantages,
        )
        for problem, completions, rewards, advantages in zip(
            problems_P, completions_P, rewards_P, advantages_P, strict=True
        )
    ]


@attrs.frozen
class StepRollouts:
    """What one step sampled and how it scored: problems, groups of completions, rewards.

    Under dynamic sampling it holds every round, in order (``rounds``; ``extra_tokens`` are
    the completion tokens the extra rounds sampled).
    """

    problems_P: tuple[Problem, ...]
    completions_P: tuple[tuple[Completion, ...], ...]
    scores: RewardScores
    rounds: int = 1
    extra_tokens: int = 0

    def extended(self, more: StepRollouts) -> StepRollouts:
        """This step's rollouts followed by one more round's."""
        sampled = sum(c.tokens.size for group in more.completions_P for c in group)
        return StepRollouts(
            problems_P=self.problems_P + more.problems_P,
            completions_P=self.completions_P + more.completions_P,
            scores=self.scores.extended(more.scores),
            rounds=self.rounds + 1,
            extra_tokens=self.extra_tokens + int(sampled),
        )

    def num_nondegenerate(self) -> int:
        """Groups whose rewards are not all equal (the ones that train)."""
        return sum(bool(np.any(rewards != rewards[0])) for rewards in self.scores.totals_P)


def grade_rollouts(
    problems_P: Sequence[Problem],
    completions_P: Sequence[Sequence[Completion]],
    config: TrainConfig,
    max_tokens: int | None = None,
) -> StepRollouts:
    """Step 3: every completion scored by the run's --reward callables (sampled with at most
    ``max_tokens``, by default the run's --max-tokens)."""
    scores = reward_groups(
        problems_P,
        completions_P,
        config.reward_fns,
        max_tokens=config.max_tokens if max_tokens is None else max_tokens,
        overlong_buffer=config.overlong_tokens,
        on_error=config.reward_errors,
        workers=config.reward_workers,
        timeout=config.reward_timeout,
    )
    return StepRollouts(
        problems_P=tuple(problems_P),
        completions_P=tuple(tuple(group) for group in completions_P),
        scores=scores,
    )


def refill(
    first: RoundsT,
    *,
    needed: int,
    max_rounds: int,
    sample_round: Callable[[int], RoundsT],
) -> RoundsT:
    """DAPO's dynamic sampling: rounds 1, 2, ... until ``needed`` non-degenerate groups.

    At most ``max_rounds`` rounds in all (the first included); ``sample_round(r)`` samples
    and grades round r (its problems and seeds are pure functions of (seed, step, r, index)).
    Works on completions (`StepRollouts`) and on episodes alike: each has ``extended``.
    """
    rollouts = first
    while rollouts.num_nondegenerate() < needed and rollouts.rounds < max_rounds:
        rollouts = rollouts.extended(sample_round(rollouts.rounds))
    return rollouts


def trainable_groups(groups_P: Sequence[GroupT], limit: int | None) -> list[GroupT]:
    """Step 5: the non-degenerate groups, the first ``limit`` of them when a limit is given."""
    kept = [group for group in groups_P if not group.is_degenerate]
    return kept if limit is None else kept[:limit]


@attrs.frozen
class PlayedGroups:
    """Episodes of a batch of tasks, with what each turn observed and the sampler usage.

    Under --dynamic-sampling it holds every round, in order (``rounds``; ``extra_tokens`` are
    the action tokens the extra rounds sampled), as `StepRollouts` does.
    """

    problems_P: tuple[Problem, ...]
    episodes_P: tuple[tuple[Episode, ...], ...]
    seen_P: tuple[tuple[tuple[str, ...], ...], ...]
    usage: TokenUsage
    rounds: int = 1
    extra_tokens: int = 0

    def extended(self, more: PlayedGroups) -> PlayedGroups:
        """These groups followed by one more round's (its usage added)."""
        sampled = sum(episode.num_sampled for group in more.episodes_P for episode in group)
        return PlayedGroups(
            problems_P=self.problems_P + more.problems_P,
            episodes_P=self.episodes_P + more.episodes_P,
            seen_P=self.seen_P + more.seen_P,
            usage=self.usage + more.usage,
            rounds=self.rounds + 1,
            extra_tokens=self.extra_tokens + int(sampled),
        )

    def num_nondegenerate(self) -> int:
        """Groups whose returns are not all equal (the ones that train)."""
        returns_P = [[episode.reward for episode in group] for group in self.episodes_P]
        sizes_P = [len(returns) for returns in returns_P]
        flat = [value for returns in returns_P for value in returns]
        return int(np.sum(~degenerate_groups(flat, sizes_P)))


Graded = StepRollouts | PlayedGroups
"""A step's groups graded: completions with their --reward scores, or played episodes."""


@attrs.frozen
class GradedStep:
    """A step's rollouts graded (every round), every group with its advantages, the groups
    that train, and the rollout metrics (``reward/*`` components, or ``env/*``)."""

    rollouts: Graded
    groups_P: tuple[RolloutGroup, ...]
    trainable_P: tuple[RolloutGroup, ...]
    metrics: dict[str, float]

    def sampling_metrics(self) -> dict[str, float]:
        """Dynamic sampling's cost and result: rounds, extra sampled tokens, groups that train."""
        return {
            "sampling/rounds": float(self.rollouts.rounds),
            "sampling/extra_tokens": float(self.rollouts.extra_tokens),
            "sampling/groups": float(len(self.trainable_P)),
        }


def graded_step(graded: Graded, method: str, *, limit: int | None, keep_all: bool) -> GradedStep:
    """Steps 4-5: every group with its advantages (``method``, of the total rewards or the
    returns) and the rollout metrics; the groups that train are the non-degenerate ones (the
    first ``limit`` when given), or all of them with ``keep_all``."""
    if isinstance(graded, PlayedGroups):
        played_P = episode_groups(graded.episodes_P, method)
        groups_P: Sequence[RolloutGroup] = played_P
        metrics = episode_metrics(played_P)
    else:
        scored_P = score_groups(
            graded.problems_P, graded.completions_P, graded.scores.totals_P, method
        )
        groups_P, metrics = scored_P, {**rollout_metrics(scored_P), **graded.scores.metrics()}
    trainable_P = groups_P if keep_all else trainable_groups(groups_P, limit)
    return GradedStep(graded, tuple(groups_P), tuple(trainable_P), metrics)
