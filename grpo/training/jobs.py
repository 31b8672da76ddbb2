"""Sampling jobs in flight: one kind for completions and episodes, submitted ahead, taken once.

A ``Job`` is a step's sampling on the run's pool: ``sampler_version`` (the updates its weights
had), ``result()`` (waits), ``usage()`` (the tokens it sent and sampled) and ``cancel()``.
`grpo.training.rollouts.RolloutJob`, `grpo.training.episodes.EpisodeJob` and a resumed
`grpo.training.ahead.ReadyJob` are all one. ``submit_rollouts`` keeps the next K steps in
flight (--max-steps-off-policy K); ``take_rollouts`` hands a step its job with its staleness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from grpo.core.usage import TokenUsage
from grpo.training.rollouts import Problem, step_problems
from grpo.training.state import Run, RunState


class Job(Protocol):
    """One step's sampling in flight."""

    @property
    def sampler_version(self) -> int: ...

    def result(self) -> Any: ...

    def usage(self) -> TokenUsage: ...

    def cancel(self) -> None: ...


def submit_rollouts(
    run: Run, state: RunState, step: int, submit: Callable[[list[Problem], int], Job]
) -> None:
    """Submit the sampling of steps ``step`` .. ``step + K`` not yet in flight (K = off-policy).

    ``submit(problems, ahead)`` starts step ``ahead``'s job on the current weights.
    """
    config = run.config
    last = min(step + config.max_steps_off_policy, run.steps - 1)
    for ahead in range(step, last + 1):
        if ahead in state.jobs:
            continue
        problems = step_problems(run.train_problems, config.batch_size, ahead, config.seed)
        state.jobs[ahead] = submit(problems, ahead)


def take_rollouts(run: Run, state: RunState, step: int) -> tuple[Job, int]:
    """Step ``step``'s job out of the in-flight ones, and its staleness (<= K, or an error)."""
    config = run.config
    job = state.jobs.pop(step)
    staleness = state.version - job.sampler_version
    if staleness > config.max_steps_off_policy:
        raise AssertionError(
            f"rollouts {staleness} steps stale > --max-steps-off-policy "
            f"{config.max_steps_off_policy}"
        )
    return job, staleness
