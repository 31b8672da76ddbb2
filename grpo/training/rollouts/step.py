"""A GRPO step's rollouts, one path for completions (single-turn) and episodes (--env).

The GRPO recipe's step (`grpo.training.recipes.grpo.recipe`) asks, in order: ``submit`` a step's
sampling (a group's first turn is one request of G samples), ``take`` the finished job,
``teacher_scoring`` (distillation), ``grade`` (refilling under --dynamic-sampling),
``advantage_groups``, ``records`` for rollouts.jsonl, the packed batch
(`grpo.core.episodes.pack_rollout_groups`), ``reference_logprobs`` (KL shaping) and
``evaluate_test``. A single completion is an episode of one turn whose reward is the
--reward list; an episode's return is the environment's. Where the two kinds differ (how a
turn is sampled and graded, what a record shows) one function branches, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from pytrio.types import ModelInput, SamplingParams

from grpo.backends.pytrio import call_with_retries
from grpo.core.episodes import RolloutGroup, episode_groups, episode_metrics, sampled_sequences
from grpo.core.metrics import rollout_metrics
from grpo.core.records import Completion
from grpo.core.usage import TokenUsage
from grpo.interrupts import request_result
from grpo.training.recipes.distill.teacher import TeacherScoring
from grpo.training.rollouts.clients import Sampler
from grpo.training.rollouts.episodes import EpisodeLimits, play_groups
from grpo.training.rollouts.evaluation import Decoding, evaluate_policy
from grpo.training.rollouts.grading import (
    Job,
    PlayedGroups,
    StepRollouts,
    grade_rollouts,
    refill,
    score_groups,
)
from grpo.training.rollouts.problems import Problem, tokenizer_max_len
from grpo.training.rollouts.records import completion_records, episode_records
from grpo.training.rollouts.sampling import Sampling
from grpo.training.run.learner import current_sampler
from grpo.training.run.run_log import RolloutRecord
from grpo.training.run.seeds import (
    Purpose,
    episode_seed,
    extra_batch,
    extra_episode_seed,
    extra_sampling_seed,
    sampling_seed,
)
from grpo.training.run.state import Run, RunState

Graded = StepRollouts | PlayedGroups
"""A step's groups graded: completions with their --reward scores, or played episodes."""


@attrs.frozen
class SampledCompletions:
    """A finished job's completions, not yet graded: G per problem, in problem order."""

    problems_P: tuple[Problem, ...]
    completions_P: tuple[tuple[Completion, ...], ...]


Sampled = SampledCompletions | PlayedGroups
"""What a finished job holds: completions to grade, or episodes with their returns."""


def submit(
    run: Run, state: RunState, problems: Sequence[Problem], step: int, round_: int = 0
) -> Job:
    """Start step ``step``'s sampling of ``problems`` on the current weights (round ``round_``
    of dynamic sampling): G completions per problem in one request (`sampling_seed`,
    `extra_sampling_seed`), or under --env G episodes per task (`episode_seed` per turn)."""
    config = run.config
    sampler = current_sampler(run, state)
    if config.env is not None:
        limits = EpisodeLimits(
            max_turns=config.max_turns,
            max_tokens=config.max_tokens,
            max_len=tokenizer_max_len(run.tokenizer),
            temperature=config.temperature,
            top_p=config.top_p,
            env_timeout_s=config.env_timeout,
            env_errors=config.env_errors,
        )

        def seed_for(episode: int, turn: int) -> int:
            if round_:
                return extra_episode_seed(config.seed, step, round_, episode, turn)
            return episode_seed(config.seed, Purpose.ENV_TRAIN, step, episode, turn)

        return play_groups(
            run.pool,
            sampler,
            run.tokenizer,
            config,
            problems,
            limits,
            group_size=config.group_size,
            seed_for=seed_for,
            max_retries=config.max_retries,
            note=run.note,
            sampler_version=state.version,
        )

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

    sampling = Sampling(run.pool, run.tokenizer, config.max_retries, run.note)
    return sampling.submit(
        sampler, problems, params, num_samples=config.group_size, sampler_version=state.version
    )


def take(state: RunState, job: Job) -> Sampled:
    """The finished job's rollouts; completions count their usage into the step's row now,
    episodes once graded (refills add theirs)."""
    result = job.result()
    if isinstance(result, PlayedGroups):
        return result
    state.usage += job.usage()
    return SampledCompletions(tuple(job.problems), tuple(tuple(group) for group in result))


def teacher_scoring(run: Run, sampled: Sampled) -> TeacherScoring:
    """The teacher's scoring of every sampled token, submitted (distillation): a completion
    after the teacher's prompt, an episode's stream at its sampled tokens."""
    teacher, config = run.teacher, run.config
    if isinstance(sampled, PlayedGroups):
        episodes = [episode for group in sampled.episodes_P for episode in group]
        return TeacherScoring.of_episodes(
            teacher, episodes, max_retries=config.max_retries, note=run.note
        )
    return TeacherScoring.of_completions(
        teacher,
        sampled.problems_P,
        sampled.completions_P,
        max_retries=config.max_retries,
        note=run.note,
    )


def _graded(run: Run, sampled: Sampled) -> Graded:
    """Completions scored by --reward; episodes are graded already (their returns)."""
    if isinstance(sampled, PlayedGroups):
        return sampled
    return grade_rollouts(sampled.problems_P, sampled.completions_P, run.config)


def grade(run: Run, state: RunState, step: int, sampled: Sampled) -> Graded:
    """The step's groups graded; extra rounds of new problems under --dynamic-sampling."""
    config = run.config
    graded = _graded(run, sampled)
    if config.dynamic_sampling:  # DAPO: more prompts until batch_size groups can train
        graded = refill(
            graded,
            needed=config.batch_size,
            max_rounds=config.max_sampling_rounds,
            sample_round=lambda round_: _extra_round(run, state, step, round_),
        )
    if isinstance(graded, PlayedGroups):
        state.usage += graded.usage
    return graded


def _extra_round(run: Run, state: RunState, step: int, round_: int) -> Graded:
    """Dynamic sampling's round ``round_`` >= 1 of ``step``: new problems (`extra_batch`) and
    seeds, current weights; a completion round counts its usage into the step's row."""
    config = run.config
    indices = extra_batch(len(run.train_problems), config.batch_size, step, round_, config.seed)
    problems = [run.train_problems[index] for index in indices]
    return _graded(run, take(state, submit(run, state, problems, step, round_)))


def advantage_groups(run: Run, graded: Graded) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Every group with its advantages (of the total rewards, or the returns), and the
    rollout metrics (``reward/*`` components, or ``env/*``)."""
    method = run.config.advantage
    if isinstance(graded, PlayedGroups):
        groups_P = episode_groups(graded.episodes_P, method)
        return list(groups_P), episode_metrics(groups_P)
    scored_P = score_groups(graded.problems_P, graded.completions_P, graded.scores.totals_P, method)
    return list(scored_P), {**rollout_metrics(scored_P), **graded.scores.metrics()}


def records(run: Run, graded: Graded, groups_P: Sequence[RolloutGroup]) -> list[RolloutRecord]:
    """The first --log-rollouts groups for rollouts.jsonl."""
    tokenizer, limit = run.tokenizer, run.config.log_rollouts
    if isinstance(graded, PlayedGroups):
        return episode_records(  # type: ignore[arg-type]
            graded.problems_P, groups_P, graded.seen_P, tokenizer, limit
        )
    return completion_records(graded, groups_P, tokenizer, limit)  # type: ignore[arg-type]


def reference_logprobs(run: Run, groups_P: Sequence[RolloutGroup]) -> tuple[np.ndarray, TokenUsage]:
    """The base model's log-probs of every sampled token, in packing order, and the usage:
    one compute_logprobs of each member's tokens (prompt + completion, or an episode's
    stream), read at its sampled positions."""
    sampler, config = run.ref_sampler, run.config

    def one(tokens: list[int], positions: np.ndarray) -> np.ndarray:
        values = call_with_retries(
            lambda: request_result(sampler.compute_logprobs(ModelInput.from_ints(tokens))),
            what="reference compute_logprobs",
            max_retries=config.max_retries,
            note=run.note,
        )
        return np.array([values[position] for position in positions], dtype=np.float64)

    sequences = sampled_sequences(groups_P)
    futures = [run.pool.submit(one, tokens.tolist(), positions) for tokens, positions in sequences]
    usage = TokenUsage(prompt_tokens=sum(tokens.size for tokens, _positions in sequences))
    return np.concatenate([future.result() for future in futures]), usage


def evaluate_test(run: Run, sampler: Sampler) -> tuple[dict[str, float], TokenUsage]:
    """The run's test evaluation (`grpo.training.rollouts.evaluation`): one sample (episode)
    per test problem at the run's temperature and top-p 1, graded as the run trains."""
    config = run.config
    result = evaluate_policy(
        sampler,
        run.test_problems,
        run.tokenizer,
        config,
        pool=run.pool,
        decoding=Decoding(temperature=config.temperature, top_p=1.0, max_tokens=config.max_tokens),
        samples=1,
        seed=config.seed,
        max_retries=config.max_retries,
        note=run.note,
    )
    return result.metrics("test/"), result.usage
