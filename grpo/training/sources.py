"""Where a GRPO step's rollouts come from: completions (single-turn) or episodes (--env).

The GRPO recipe's step (`grpo.training.recipes.grpo`) reads one story for both; a source
answers each of its questions for its kind of rollout: submit a step's sampling as a
`grpo.training.jobs.Job`, take the finished job, grade it (refilling under
--dynamic-sampling), group advantages and rollout metrics, the records of rollouts.jsonl,
the packed batch, the truncated sequences, the base model's and the teacher's log-probs of
the sampled tokens, and the test evaluation. A single completion is an episode of one turn
whose reward is the --reward list; an episode's return is the environment's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from pytrio.types import SamplingParams

from grpo.core.alignment import pack_groups, truncated_sequences
from grpo.core.episodes import (
    episode_groups,
    episode_metrics,
    pack_episode_groups,
    truncated_episodes,
)
from grpo.core.metrics import rollout_metrics
from grpo.core.records import TokenBatch
from grpo.core.usage import TokenUsage, reference_usage
from grpo.training.config import TrainConfig
from grpo.training.episodes import (
    EpisodeJob,
    PlayedGroups,
    episode_records,
    reference_episode_logprobs,
    submit_groups,
)
from grpo.training.evaluation import Decoding, evaluation_row
from grpo.training.jobs import Job
from grpo.training.learner import current_sampler
from grpo.training.rollouts import (
    Problem,
    RolloutJob,
    Sampling,
    StepRollouts,
    grade_rollouts,
    reference_logprobs,
    refill,
    score_groups,
)
from grpo.training.run_log import rollout_records
from grpo.training.seeds import Purpose, extra_batch, extra_sampling_seed, sampling_seed
from grpo.training.state import Run, RunState
from grpo.training.teacher import TeacherScoring


class RolloutSource(Protocol):
    """One kind of rollout, as the GRPO step asks for it (``Completions``, ``Episodes``)."""

    def submit(self, run: Run, state: RunState, problems: list[Problem], step: int) -> Job:
        """Start step ``step``'s sampling of ``problems`` on the current weights."""
        ...

    def take(self, state: RunState, job: Job) -> Any:
        """The finished job's rollouts (its usage counted into the step's row)."""
        ...

    def teacher_scoring(self, run: Run, sampled: Any) -> TeacherScoring:
        """The teacher's scoring of every sampled token, submitted (distillation)."""
        ...

    def grade(self, run: Run, state: RunState, step: int, sampled: Any) -> Any:
        """The step's rollouts graded, refilled to --batch-size groups under dynamic sampling."""
        ...

    def groups(self, run: Run, played: Any) -> tuple[list[Any], dict[str, float]]:
        """Every group with its advantages, and the rollout metrics."""
        ...

    def records(self, run: Run, played: Any, groups_P: Sequence[Any]) -> list[dict[str, Any]]:
        """The first --log-rollouts groups for rollouts.jsonl."""
        ...

    def pack(self, groups_P: Sequence[Any]) -> TokenBatch:
        """The groups aligned and packed, in sampling order."""
        ...

    def truncated(self, groups_P: Sequence[Any]) -> np.ndarray:
        """Which packed sequences stopped at a length limit."""
        ...

    def reference(self, run: Run, groups_P: Sequence[Any]) -> tuple[np.ndarray, TokenUsage]:
        """The base model's log-probs of every sampled token, in packing order, and usage."""
        ...

    def evaluate(self, run: Run, sampler: Any) -> tuple[dict[str, float], TokenUsage]:
        """The test evaluation of ``sampler`` graded as the run trains (its reward or return)."""
        ...


class Completions:
    """Single-turn rollouts: G completions per problem, graded by the run's --reward list."""

    def submit(self, run: Run, state: RunState, problems: list[Problem], step: int) -> Job:
        """One sampling request of G completions per problem (seeds from `sampling_seed`)."""
        return _sample(run, state, problems, _sampling_params(run.config, step))

    def take(self, state: RunState, job: Job) -> tuple[tuple[Problem, ...], Any]:
        """(problems, completions per problem) of the finished job."""
        completions_P = job.result()
        state.usage += job.usage()
        return tuple(getattr(job, "problems")), completions_P

    def teacher_scoring(self, run: Run, sampled: Any) -> TeacherScoring:
        """Each completion scored after the teacher's prompt."""
        problems, completions_P = sampled
        return TeacherScoring.of_completions(
            run.teacher, problems, completions_P, max_retries=run.config.max_retries, log=run.note
        )

    def grade(self, run: Run, state: RunState, step: int, sampled: Any) -> StepRollouts:
        """Every completion scored by --reward; extra rounds under --dynamic-sampling."""
        config = run.config
        rollouts = grade_rollouts(*sampled, config)
        if config.dynamic_sampling:  # DAPO: more prompts until batch_size groups can train
            rollouts = refill(
                rollouts,
                needed=config.batch_size,
                max_rounds=config.max_sampling_rounds,
                sample_round=lambda round_: _sample_extra_round(run, state, step, round_),
            )
        return rollouts

    def groups(self, run: Run, played: StepRollouts) -> tuple[list[Any], dict[str, float]]:
        """Group advantages of the total rewards (a group of equal rewards is degenerate)."""
        groups_P = score_groups(
            played.problems_P, played.completions_P, played.scores.totals_P, run.config.advantage
        )
        return groups_P, {**rollout_metrics(groups_P), **played.scores.metrics()}

    def records(self, run: Run, played: StepRollouts, groups_P: Sequence[Any]) -> list[dict]:
        """Prompt, completions, rewards and components of the first groups."""
        return rollout_records(played, groups_P, run.tokenizer, run.config.log_rollouts)

    def pack(self, groups_P: Sequence[Any]) -> TokenBatch:
        """Prompt + completion of every member, completion tokens trained."""
        return pack_groups(groups_P, drop_degenerate=False)

    def truncated(self, groups_P: Sequence[Any]) -> np.ndarray:
        """Completions stopped by --max-tokens."""
        return truncated_sequences(groups_P)

    def reference(self, run: Run, groups_P: Sequence[Any]) -> tuple[np.ndarray, TokenUsage]:
        """One compute_logprobs of prompt + completion per member."""
        config = run.config
        values = reference_logprobs(
            run.pool, run.ref_sampler, groups_P, config.max_retries, run.note
        )
        return values, reference_usage(groups_P)

    def evaluate(self, run: Run, sampler: Any) -> tuple[dict[str, float], TokenUsage]:
        """One sample per test problem at the run's temperature, graded by --reward."""
        return evaluate_now(run, sampler)


class Episodes:
    """Multi-turn rollouts (--env): G episodes per task, their returns the environment's."""

    def submit(self, run: Run, state: RunState, problems: list[Problem], step: int) -> Job:
        """G episodes per task on the run's pool (turn seeds from `episode_seed`)."""
        return _play(run, state, problems, step)

    def take(self, state: RunState, job: Job) -> PlayedGroups:
        """The finished episodes (their usage is counted once graded: refills add theirs)."""
        return job.result()

    def teacher_scoring(self, run: Run, sampled: PlayedGroups) -> TeacherScoring:
        """Each episode's stream scored at its sampled tokens (observations are context)."""
        episodes = [episode for group in sampled.episodes_P for episode in group]
        return TeacherScoring.of_episodes(
            run.teacher, episodes, max_retries=run.config.max_retries, log=run.note
        )

    def grade(self, run: Run, state: RunState, step: int, sampled: PlayedGroups) -> PlayedGroups:
        """The returns are the env's; extra rounds of tasks under --dynamic-sampling."""
        config = run.config
        played = sampled
        if config.dynamic_sampling:  # DAPO: play more tasks until batch_size groups can train
            played = refill(
                played,
                needed=config.batch_size,
                max_rounds=config.max_sampling_rounds,
                sample_round=lambda round_: _play_extra_round(run, state, step, round_),
            )
        state.usage += played.usage
        return played

    def groups(self, run: Run, played: PlayedGroups) -> tuple[list[Any], dict[str, float]]:
        """Group advantages of the returns, and the ``env/*`` metrics."""
        groups_P = episode_groups(played.episodes_P, run.config.advantage)
        return groups_P, episode_metrics(groups_P)

    def records(self, run: Run, played: PlayedGroups, groups_P: Sequence[Any]) -> list[dict]:
        """Each episode's transcript and turns, of the first groups."""
        return episode_records(
            played.problems_P, groups_P, played.seen_P, run.tokenizer, run.config.log_rollouts
        )

    def pack(self, groups_P: Sequence[Any]) -> TokenBatch:
        """Each episode's stream, its sampled tokens trained (observations are inputs only)."""
        return pack_episode_groups(groups_P, drop_degenerate=False)

    def truncated(self, groups_P: Sequence[Any]) -> np.ndarray:
        """Episodes whose last turn hit a length limit."""
        return truncated_episodes(groups_P)

    def reference(self, run: Run, groups_P: Sequence[Any]) -> tuple[np.ndarray, TokenUsage]:
        """One compute_logprobs of each episode's stream, read at its sampled tokens."""
        return reference_episode_logprobs(run, groups_P)

    def evaluate(self, run: Run, sampler: Any) -> tuple[dict[str, float], TokenUsage]:
        """One episode per test task: the return's metrics, tool use and turns."""
        return evaluate_now(run, sampler)


def evaluate_now(run: Run, sampler: Any) -> tuple[dict[str, float], TokenUsage]:
    """The run's test evaluation (`grpo.training.evaluation`): one sample (episode) per test
    problem at the run's temperature and top-p 1, graded as the run trains."""
    config = run.config
    return evaluation_row(
        sampler,
        run.test_problems,
        run.tokenizer,
        config,
        pool=run.pool,
        decoding=Decoding(temperature=config.temperature, top_p=1.0, max_tokens=config.max_tokens),
        samples=1,
        seed=config.seed,
        max_retries=config.max_retries,
        log=run.note,
    )


def source_of(config: TrainConfig) -> RolloutSource:
    """The run's rollouts: episodes under --env, else completions."""
    return Episodes() if config.env is not None else Completions()


def _sample(
    run: Run, state: RunState, problems: list[Problem], params_for: Callable[[int], SamplingParams]
) -> RolloutJob:
    """A group of --group-size completions per problem, from the sampler of the current weights."""
    sampling = Sampling(run.pool, run.tokenizer, run.config.max_retries, run.note)
    return sampling.submit(
        current_sampler(run, state),
        problems,
        params_for,
        num_samples=run.config.group_size,
        sampler_version=state.version,
    )


def _sampling_params(
    config: TrainConfig, step: int, round_: int = 0
) -> Callable[[int], SamplingParams]:
    def params(index: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=(
                sampling_seed(config.seed, step, index)
                if round_ == 0
                else extra_sampling_seed(config.seed, step, round_, index)
            ),
        )

    return params


def _sample_extra_round(run: Run, state: RunState, step: int, round_: int) -> StepRollouts:
    """Dynamic sampling's round ``round_`` of ``step``: new problems and seeds, current weights."""
    config = run.config
    indices = extra_batch(len(run.train_problems), config.batch_size, step, round_, config.seed)
    problems = [run.train_problems[index] for index in indices]
    job = _sample(run, state, problems, _sampling_params(config, step, round_))
    completions_P = job.result()
    state.usage += job.usage()  # the step's row counts every round's tokens
    return grade_rollouts(problems, completions_P, config)


def _play(
    run: Run, state: RunState, problems: Sequence[Problem], step: int, round_: int = 0
) -> EpisodeJob:
    config = run.config
    return submit_groups(
        run,
        current_sampler(run, state),
        problems,
        group_size=config.group_size,
        temperature=config.temperature,
        purpose=Purpose.ENV_TRAIN,
        step=step,
        round_=round_,
        sampler_version=state.version,
    )


def _play_extra_round(run: Run, state: RunState, step: int, round_: int) -> PlayedGroups:
    """Dynamic sampling's round ``round_`` >= 1 of ``step``: new tasks (`extra_batch`, as the
    single-turn path draws them) and new turn seeds (`extra_episode_seed`), current weights."""
    config = run.config
    indices = extra_batch(len(run.train_problems), config.batch_size, step, round_, config.seed)
    problems = [run.train_problems[index] for index in indices]
    return _play(run, state, problems, step, round_).result()
