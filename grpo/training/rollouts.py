"""Rollouts: problems, sampling jobs, grading, reference log-probs and evaluation.

Everything the single-turn loop asks of a sampler lives here. Every random choice is a
pure function drawn in `grpo.training.seeds` (which problems, every request's seed), so a
run resumed from a checkpoint samples exactly what it would have.
Suffixes name axes (docs/DESIGN.md): ``_P`` one per problem of a step, ``_C`` one per
completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import attrs
import numpy as np
from pytrio.types import ModelInput, SamplingParams

from grpo.backends.pytrio import call_with_retries
from grpo.core.advantages import group_advantages
from grpo.core.records import Completion, ScoredGroup
from grpo.core.rewards import RewardInput, extract_gold
from grpo.core.usage import TokenUsage, sample_usage
from grpo.interrupts import request_result
from grpo.reward_calls import active_caller
from grpo.reward_scores import RewardScores, score_completions
from grpo.rewards import RewardFn
from grpo.tasks.data import columns_of
from grpo.tasks.prompts import DEFAULT_TEMPLATE, PromptTemplate, build_prompt_tokens
from grpo.training.config import ConfigError
from grpo.training.seeds import pick_batch

Log = Callable[[str], None]


class Rounds(Protocol):
    """What `refill` needs of a step's sampled groups (`StepRollouts`; under --env the
    episodes' `grpo.training.episodes.PlayedGroups`)."""

    @property
    def rounds(self) -> int: ...

    def num_nondegenerate(self) -> int: ...

    def extended(self, more: Any) -> Any: ...


class Group(Protocol):
    """What `trainable_groups` needs of a group (`ScoredGroup`, `EpisodeGroup`)."""

    @property
    def is_degenerate(self) -> bool: ...


RoundsT = TypeVar("RoundsT", bound=Rounds)
GroupT = TypeVar("GroupT", bound=Group)


@attrs.frozen
class Problem:
    """One training or test problem, ready to sample: its prompt tokens and gold answer.

    `index` is the row's index in its split and `row` its columns (what rewards read).
    """

    question: str
    gold: str
    prompt_tokens: tuple[int, ...]
    index: int = 0
    row: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)


def tokenizer_max_len(tokenizer: Any) -> int | None:
    """The model's context length when the tokenizer states a believable one."""
    value = getattr(tokenizer, "model_max_length", None)
    return int(value) if isinstance(value, int) and 0 < value < 10_000_000 else None


def build_problems(
    tokenizer: Any,
    rows: Any,
    *,
    fewshot: bool,
    max_tokens: int,
    max_len: int | None,
    split: str,
    template: PromptTemplate = DEFAULT_TEMPLATE,
    columns: tuple[str, str, str] = ("question", "answer", "####"),
) -> list[Problem]:
    """Prompt tokens and gold answers for dataset rows; an over-long prompt is a ConfigError.

    `columns` = (question column, answer column, gold rule), see `grpo.tasks.data.problem_columns`.
    """
    prompt_column, answer_column, gold_rule = columns
    problems = []
    for index, row in enumerate(rows):
        question = row[prompt_column]
        tokens = build_prompt_tokens(tokenizer, question, fewshot=fewshot, template=template)
        if max_len is not None and len(tokens) + max_tokens > max_len:
            raise ConfigError(
                f"{split} problem {index}: prompt has {len(tokens)} tokens + --max-tokens "
                f"{max_tokens} exceeds the model's {max_len} positions; lower --max-tokens or "
                "drop long problems"
            )
        problems.append(
            Problem(
                question=question,
                gold=extract_gold(str(row[answer_column]), gold_rule),
                prompt_tokens=tuple(tokens),
                index=index,
                row=dict(row),
            )
        )
    return problems


def run_problem_options(config: Any, split: str, *, max_len: int | None) -> dict[str, Any]:
    """The keyword arguments of `build_problems` for a run config: --fewshot, --max-tokens,
    --prompt-template and the dataset's columns (`grpo.tasks.data.columns_of`)."""
    return {
        "fewshot": config.use_fewshot,
        "max_tokens": config.max_tokens,
        "max_len": max_len,
        "split": split,
        "template": config.prompt_template,
        "columns": columns_of(config),
    }


def run_problems(
    tokenizer: Any, rows: Any, config: Any, split: str, *, max_len: int | None
) -> list[Problem]:
    """`build_problems` with a run config's prompt settings (`run_problem_options`)."""
    return build_problems(tokenizer, rows, **run_problem_options(config, split, max_len=max_len))


def step_problems(
    problems: Sequence[Problem], batch_size: int, step: int, seed: int
) -> list[Problem]:
    """Step ``step``'s problems: ``problems`` at the indices `pick_batch` gives."""
    return [problems[index] for index in pick_batch(len(problems), batch_size, step, seed)]


def _completion_from(sequence: Any, tokenizer: Any) -> Completion:
    """A core Completion from one sampled sequence (text decoded if the backend gave none)."""
    text = sequence.text if sequence.text is not None else tokenizer.decode(sequence.tokens)
    return Completion(
        tokens=sequence.tokens,
        logprobs=sequence.logprobs,
        text=text,
        stop_reason=sequence.stop_reason,
    )


class RolloutJob:
    """One step's sampling requests on a bounded pool; ``result()`` waits for all groups."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        sampler: Any,
        problems: Sequence[Problem],
        *,
        params_for: Callable[[int], SamplingParams],
        num_samples: int,
        tokenizer: Any,
        max_retries: int,
        log: Log,
        sampler_version: int,
    ) -> None:
        self.sampler_version = sampler_version
        self.problems = list(problems)
        self._usage_P = [TokenUsage() for _ in self.problems]

        def sample_one(index: int) -> list[Completion]:
            prompt = ModelInput.from_ints(list(self.problems[index].prompt_tokens))
            response = call_with_retries(
                lambda: request_result(
                    sampler.sample(
                        prompt=prompt,
                        num_samples=num_samples,
                        sampling_params=params_for(index),
                        return_text=True,
                    )
                ),
                what=f"sample (problem {index})",
                max_retries=max_retries,
                on_retry=log,
            )
            self._usage_P[index] = sample_usage(
                response.input_tokens,
                response.output_tokens,
                len(prompt),
                (len(sequence.tokens) for sequence in response.sequences),
            )
            return [_completion_from(sequence, tokenizer) for sequence in response.sequences]

        self._futures: list[Future[list[Completion]]] = [
            pool.submit(sample_one, index) for index in range(len(self.problems))
        ]

    def result(self) -> list[list[Completion]]:
        """The completions of every problem, in problem order."""
        return [future.result() for future in self._futures]

    def usage(self) -> TokenUsage:
        """Tokens the job's requests sent and sampled (complete once ``result()`` returned)."""
        return sum(self._usage_P, TokenUsage())

    def cancel(self) -> None:
        """Drop requests that have not started."""
        for future in self._futures:
            future.cancel()


@attrs.frozen
class Sampling:
    """Where a run's sampling requests go: its thread pool, the tokenizer that decodes a
    completion the backend returned without text, the retries of a request, the log."""

    pool: ThreadPoolExecutor
    tokenizer: Any
    max_retries: int
    log: Log

    def submit(
        self,
        sampler: Any,
        problems: Sequence[Problem],
        params_for: Callable[[int], SamplingParams],
        *,
        num_samples: int,
        sampler_version: int = 0,
    ) -> RolloutJob:
        """``num_samples`` completions of every problem; request ``i`` samples ``params_for(i)``."""
        return RolloutJob(
            self.pool,
            sampler,
            problems,
            params_for=params_for,
            num_samples=num_samples,
            tokenizer=self.tokenizer,
            max_retries=self.max_retries,
            log=self.log,
            sampler_version=sampler_version,
        )


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
    """Every --reward of every completion (see `grpo.reward_scores.score_completions`), called by
    the run's reward caller when one is active (`grpo.reward_calls.reward_session`)."""
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


def reference_logprobs(
    pool: ThreadPoolExecutor,
    ref_sampler: Any,
    groups: Sequence[ScoredGroup],
    max_retries: int,
    log: Log,
) -> np.ndarray:
    """Base-model log-probs of every sampled completion token, concatenated in packing order.

    Obtained as the prompt log-probs of prompt + completion, one request per completion.
    """

    def one(prompt_tokens: tuple[int, ...], completion: Completion) -> np.ndarray:
        tokens = [*prompt_tokens, *completion.tokens.tolist()]
        values = call_with_retries(
            lambda: request_result(ref_sampler.compute_logprobs(ModelInput.from_ints(tokens))),
            what="reference compute_logprobs",
            max_retries=max_retries,
            on_retry=log,
        )
        return np.asarray(values[-len(completion.tokens) :], dtype=np.float64)

    futures_C = [
        pool.submit(one, tuple(group.prompt_tokens.tolist()), completion)
        for group in groups
        for completion in group.completions
    ]
    return np.concatenate([future.result() for future in futures_C])


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
    config: Any,
    max_tokens: int | None = None,
) -> StepRollouts:
    """Step 5: every completion scored by the run's --reward callables (sampled with at most
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
    """Step 7: the non-degenerate groups, the first ``limit`` of them when a limit is given."""
    kept = [group for group in groups_P if not group.is_degenerate]
    return kept if limit is None else kept[:limit]
