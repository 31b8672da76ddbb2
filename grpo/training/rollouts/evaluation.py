"""One evaluation for `grpo eval` and in-training evaluation: sample, grade, the metrics.

n samples of every problem with stated decoding (temperature, top-p, max tokens) and a seed,
graded by the run's task: its `--reward` list (single completions) or its `--env`
(episodes). Each sample becomes a row of a `grpo.core.evaluation.EvalSamples`, from which
the core computes avg@n, pass@k, cons@n, format and truncation rates (docs/FORMULAS.md,
"Evaluation metrics"):

- correct: the first `--reward` component scores >= 1 (under `--env`: the return R >= 1);
- answer: the last `\\boxed{}`, normalized (the code rewards: the last fenced Python block);
- truncated: stopped by max_tokens (under `--env`: the last turn did not stop by itself).

Entry points: `evaluate_policy` samples and grades one seed (a sampler, the problems, the
tokenizer, the run's `TrainConfig`); its `Evaluation.metrics` are the metrics as logged
(``test/avg@n`` ...), the shape in-training evaluation logs;
`completion_samples` / `episode_samples` build the record from samples already drawn.
Request seeds are drawn in `grpo.training.run.seeds` (the evaluation streams), so the same seed
samples the same completions in `grpo eval` and in the run's own evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs
import numpy as np
from pytrio.types import SamplingParams

from grpo.core.episodes import Episode
from grpo.core.evaluation import EvalSamples, evaluation_metrics
from grpo.core.records import Completion
from grpo.core.rewards import extract_boxed, normalize_answer
from grpo.core.usage import TokenUsage
from grpo.rewards import RewardFn
from grpo.rewards.code_grading import last_python_block
from grpo.rewards.scores import RewardScores
from grpo.training.rollouts.clients import Sampler, Tokenizer
from grpo.training.rollouts.episodes import EpisodeLimits, play_groups
from grpo.training.rollouts.grading import Job, PlayedGroups, grade_rollouts
from grpo.training.rollouts.problems import Problem, tokenizer_max_len
from grpo.training.rollouts.sampling import Note, Sampling
from grpo.training.run.seeds import Purpose, episode_seed, sampling_seed
from grpo.training.settings.config import TrainConfig

AnswerOf = Callable[[str], "str | None"]

CODE_REWARDS = frozenset({"code_tests", "code_tests_partial"})
CORRECT_AT_LEAST = 1.0


@attrs.frozen
class Decoding:
    """How an evaluation samples: temperature, nucleus threshold, tokens per completion (turn)."""

    temperature: float
    top_p: float
    max_tokens: int

    def as_dict(self) -> dict[str, float | int]:
        """The settings as recorded in a result."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}


@attrs.frozen
class Evaluation:
    """One seed's graded samples and the tokens it used."""

    samples: EvalSamples
    usage: TokenUsage
    extra: dict[str, float] = attrs.field(factory=dict)
    """What a training row logs beside the samples' metrics: each --reward component's mean
    (``test/<component>``, as ``reward/<component>`` in training) and ``reward_errors``, or
    under --env the share of episodes that called a tool (``tool_use``)."""

    def metrics(self, prefix: str = "test/") -> dict[str, float]:
        """`grpo.core.evaluation.evaluation_metrics` of the samples (``test/avg@n`` ...) and
        the extra means."""
        found = evaluation_metrics(self.samples, prefix=prefix)
        found.update({f"{prefix}{name}": value for name, value in self.extra.items()})
        return found


def boxed_answer(text: str) -> str | None:
    """The normalized content of the last `\\boxed{}`; None when absent or empty."""
    answer = extract_boxed(text)
    if answer is None:
        return None
    normalized = normalize_answer(answer)
    return normalized or None


def code_answer(text: str) -> str | None:
    """The last fenced Python block, stripped; None when absent or empty."""
    block = last_python_block(text)
    return block.strip() or None if block is not None else None


def answer_extractor(rewards: Sequence[RewardFn]) -> AnswerOf:
    """What a sample's answer is for the grader (the first reward): code or a boxed answer."""
    return code_answer if rewards and rewards[0].name in CODE_REWARDS else boxed_answer


def correctness(scores: RewardScores, grader: str) -> list[np.ndarray]:
    """c of every completion: the first component of reward `grader` scores >= 1."""
    names = [name for name in scores.weights if name == grader or name.startswith(f"{grader}/")]
    if not names:
        return [np.zeros(total.size, dtype=bool) for total in scores.totals_P]
    return [
        group.get(names[0], np.zeros(total.size)) >= CORRECT_AT_LEAST
        for group, total in zip(scores.components_P, scores.totals_P, strict=True)
    ]


def completion_samples(
    completions_P: Sequence[Sequence[Completion]],
    scores: RewardScores,
    rewards: Sequence[RewardFn],
) -> EvalSamples:
    """The record of n graded completions per problem (what a step or an eval sampled)."""
    answer_of = answer_extractor(rewards)
    grader = rewards[0].name if rewards else ""
    return EvalSamples(
        correct_PG=correctness(scores, grader),
        answers_PG=[[answer_of(c.text) for c in group] for group in completions_P],
        truncated_PG=[[c.is_truncated for c in group] for group in completions_P],
        tokens_PG=[[c.tokens.size for c in group] for group in completions_P],
        reward_PG=scores.totals_P,
    )


def episode_samples(episodes_P: Sequence[Sequence[Episode]]) -> EvalSamples:
    """The record of n episodes per problem: correct when the return R >= 1, the answer of
    the last turn's action, its turns and tool calls."""
    return EvalSamples(
        correct_PG=[[e.reward >= CORRECT_AT_LEAST for e in group] for group in episodes_P],
        answers_PG=[[boxed_answer(e.turns[-1].action_text) for e in group] for group in episodes_P],
        truncated_PG=[[e.is_truncated for e in group] for group in episodes_P],
        tokens_PG=[[e.num_sampled for e in group] for group in episodes_P],
        reward_PG=[[e.reward for e in group] for group in episodes_P],
        turns_PG=[[e.num_turns for e in group] for group in episodes_P],
        tool_calls_PG=[[sum(t.tool_calls for t in e.turns) for e in group] for group in episodes_P],
    )


def _submit(
    pool: ThreadPoolExecutor,
    sampler: Sampler,
    problems: Sequence[Problem],
    tokenizer: Tokenizer,
    config: TrainConfig,
    *,
    decoding: Decoding,
    samples: int,
    seed: int,
    max_retries: int,
    note: Note,
) -> Job:
    """``samples`` completions of every problem in one request each, or under --env
    ``samples`` episodes of every problem's env; seeds of the evaluation streams."""
    if config.env is not None:
        limits = EpisodeLimits(
            max_turns=config.max_turns,
            max_tokens=decoding.max_tokens,
            max_len=tokenizer_max_len(tokenizer),
            temperature=decoding.temperature,
            top_p=decoding.top_p,
            env_timeout_s=config.env_timeout,
            env_errors=config.env_errors,
        )
        return play_groups(
            pool,
            sampler,
            tokenizer,
            config,
            problems,
            limits,
            group_size=samples,
            seed_for=lambda episode, turn: episode_seed(seed, Purpose.ENV_EVAL, 0, episode, turn),
            max_retries=max_retries,
            note=note,
        )

    def params(index: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=decoding.max_tokens,
            temperature=decoding.temperature,
            top_p=decoding.top_p,
            seed=sampling_seed(seed, 0, index, purpose=Purpose.EVAL),
        )

    return Sampling(pool, tokenizer, max_retries, note).submit(
        sampler, problems, params, num_samples=samples
    )


def _graded(
    job: Job, problems: Sequence[Problem], config: TrainConfig, decoding: Decoding
) -> Evaluation:
    """The finished job's samples graded: completions by --reward (each component's mean and
    ``reward_errors`` beside), episodes by their returns (``tool_use`` beside)."""
    result = job.result()
    if isinstance(result, PlayedGroups):
        calls = [
            sum(turn.tool_calls for turn in episode.turns)
            for group in result.episodes_P
            for episode in group
        ]
        return Evaluation(
            samples=episode_samples(result.episodes_P),
            usage=result.usage,
            extra={"tool_use": float(np.mean([count > 0 for count in calls]))},
        )
    scores = grade_rollouts(problems, result, config, decoding.max_tokens).scores
    extra = {
        ("reward_errors" if key == "reward/errors" else key.removeprefix("reward/")): value
        for key, value in scores.metrics().items()
    }
    return Evaluation(
        samples=completion_samples(result, scores, config.reward_fns),
        usage=job.usage(),
        extra=extra,
    )


def evaluate_policy(
    sampler: Sampler,
    problems: Sequence[Problem],
    tokenizer: Tokenizer,
    config: TrainConfig,
    *,
    pool: ThreadPoolExecutor,
    decoding: Decoding,
    samples: int,
    seed: int,
    max_retries: int = 3,
    note: Note = print,
) -> Evaluation:
    """`samples` completions (or episodes, with `config.env`) of every problem, graded.

    `config` is the run's `TrainConfig` (its
    rewards, env, max turns and prompt settings); `seed` seeds every request.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not problems:
        raise ValueError("an evaluation needs at least one problem")
    job = _submit(
        pool,
        sampler,
        problems,
        tokenizer,
        config,
        decoding=decoding,
        samples=samples,
        seed=seed,
        max_retries=max_retries,
        note=note,
    )
    return _graded(job, problems, config, decoding)
