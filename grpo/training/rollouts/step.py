"""A GRPO step's rollouts, one path for completions (single-turn) and episodes (--env).

The GRPO recipe's step (`grpo.training.recipes.grpo.recipe`) asks, in order: ``submit_ahead``
(the step's sampling and that of the next K steps not yet in flight: ``submit`` picks a
round's problems and seeds, `grpo.training.run.seeds.RoundSeeds`; a group's first turn is
one request of G samples), ``take`` the step's finished job with its staleness, ``grade``
(refilling under --dynamic-sampling; advantages and the groups that train, one
`grpo.training.rollouts.grading.GradedStep`, whose rollouts.jsonl records are
`grpo.training.rollouts.records.step_records`), the packed batch
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
from grpo.core.episodes import RolloutGroup, sampled_sequences
from grpo.core.records import Completion
from grpo.core.usage import TokenUsage
from grpo.interrupts import request_result
from grpo.training.rollouts.clients import Sampler
from grpo.training.rollouts.episodes import EpisodeLimits, play_groups
from grpo.training.rollouts.evaluation import Decoding, evaluate_policy
from grpo.training.rollouts.grading import (
    Graded,
    GradedStep,
    Job,
    PlayedGroups,
    grade_rollouts,
    graded_step,
    refill,
)
from grpo.training.rollouts.problems import Problem, tokenizer_max_len
from grpo.training.rollouts.sampling import Sampling
from grpo.training.run.learner import current_sampler
from grpo.training.run.seeds import RoundSeeds
from grpo.training.run.state import Run, RunState


@attrs.frozen
class SampledCompletions:
    """A finished job's completions, not yet graded: G per problem, in problem order."""

    problems_P: tuple[Problem, ...]
    completions_P: tuple[tuple[Completion, ...], ...]


Sampled = SampledCompletions | PlayedGroups
"""What a finished job holds: completions to grade, or episodes with their returns."""


def submit_ahead(run: Run, state: RunState, step: int) -> None:
    """Steps 1-2: submit the sampling of steps ``step`` .. ``step + K`` not yet in flight
    (K = --max-steps-off-policy), each on the current weights."""
    last = min(step + run.config.max_steps_off_policy, run.steps - 1)
    for ahead in range(step, last + 1):
        if ahead not in state.jobs:
            state.jobs[ahead] = submit(run, state, ahead)


def submit(run: Run, state: RunState, step: int, round_: int = 0) -> Job:
    """Start sampling round ``round_`` of step ``step`` on the current weights (round 0 is the
    step's batch, a round >= 1 dynamic sampling's): the round's problems and seeds are
    `RoundSeeds`'; G completions per problem in one request, or under --env G episodes per
    task."""
    config = run.config
    seeds = RoundSeeds(config.seed, step, round_)
    indices = seeds.problem_indices(len(run.train_problems), config.batch_size)
    problems = [run.train_problems[index] for index in indices]
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
        return play_groups(
            run.pool,
            sampler,
            run.tokenizer,
            config,
            problems,
            limits,
            group_size=config.group_size,
            seed_for=seeds.turn,
            max_retries=config.max_retries,
            note=run.note,
            sampler_version=state.version,
        )

    def params(index: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=seeds.request(index),
        )

    sampling = Sampling(run.pool, run.tokenizer, config.max_retries, run.note)
    return sampling.submit(
        sampler, problems, params, num_samples=config.group_size, sampler_version=state.version
    )


def take(run: Run, state: RunState, step: int) -> tuple[Sampled, int]:
    """Step ``step``'s rollouts, out of the jobs in flight (waiting for them), and their
    staleness (<= K, or an error)."""
    config = run.config
    job = state.jobs.pop(step)
    staleness = state.version - job.sampler_version
    if staleness > config.max_steps_off_policy:
        raise AssertionError(
            f"rollouts {staleness} steps stale > --max-steps-off-policy "
            f"{config.max_steps_off_policy}"
        )
    return _sampled(state, job), staleness


def _sampled(state: RunState, job: Job) -> Sampled:
    """The finished job's rollouts; completions count their usage into the step's row now,
    episodes once graded (refills add theirs)."""
    result = job.result()
    if isinstance(result, PlayedGroups):
        return result
    state.usage += job.usage()
    return SampledCompletions(tuple(job.problems), tuple(tuple(group) for group in result))


def _graded(run: Run, sampled: Sampled) -> Graded:
    """Completions scored by --reward; episodes are graded already (their returns)."""
    if isinstance(sampled, PlayedGroups):
        return sampled
    return grade_rollouts(sampled.problems_P, sampled.completions_P, run.config)


def grade(run: Run, state: RunState, step: int, sampled: Sampled, *, keep_all: bool) -> GradedStep:
    """Steps 3-5: the step's groups graded (extra rounds of new problems under
    --dynamic-sampling), their advantages and rollout metrics, and the groups that train:
    the non-degenerate ones (the first --batch-size under --dynamic-sampling), or every
    group with ``keep_all`` (distillation: the teacher scores them all)."""
    config = run.config
    graded = _graded(run, sampled)
    limit = None
    if config.dynamic_sampling:  # DAPO: more prompts until batch_size groups can train
        graded = refill(
            graded,
            needed=config.batch_size,
            max_rounds=config.max_sampling_rounds,
            sample_round=lambda round_: _graded(
                run, _sampled(state, submit(run, state, step, round_))
            ),
        )
        limit = config.batch_size
    if isinstance(graded, PlayedGroups):
        state.usage += graded.usage
    return graded_step(graded, config.advantage, limit=limit, keep_all=keep_all)


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
