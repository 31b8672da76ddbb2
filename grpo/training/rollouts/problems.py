"""The problems a run samples: prompt tokens, gold answer and dataset row of each.

Every random choice is a pure function drawn in `grpo.training.run.seeds` (which problems a
step takes), so a run resumed from a checkpoint samples exactly what it would have.
Suffixes name axes (docs/DESIGN.md): ``_P`` one per problem of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from grpo.core.rewards import extract_gold
from grpo.tasks.data import columns_of
from grpo.tasks.prompts import DEFAULT_TEMPLATE, PromptTemplate, build_prompt_tokens
from grpo.training.rollouts.clients import Tokenizer
from grpo.training.run.seeds import pick_batch
from grpo.training.settings.config import ConfigError, TrainConfig


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


def tokenizer_max_len(tokenizer: Tokenizer) -> int | None:
    """The model's context length when the tokenizer states a believable one."""
    value = getattr(tokenizer, "model_max_length", None)
    return int(value) if isinstance(value, int) and 0 < value < 10_000_000 else None


def build_problems(
    tokenizer: Tokenizer,
    rows: Iterable[Mapping[str, Any]],
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


def run_problem_options(config: TrainConfig, split: str, *, max_len: int | None) -> dict[str, Any]:
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
    tokenizer: Tokenizer,
    rows: Iterable[Mapping[str, Any]],
    config: TrainConfig,
    split: str,
    *,
    max_len: int | None,
) -> list[Problem]:
    """`build_problems` with a run config's prompt settings (`run_problem_options`)."""
    return build_problems(tokenizer, rows, **run_problem_options(config, split, max_len=max_len))


def step_problems(
    problems: Sequence[Problem], batch_size: int, step: int, seed: int
) -> list[Problem]:
    """Step ``step``'s problems: ``problems`` at the indices `pick_batch` gives."""
    return [problems[index] for index in pick_batch(len(problems), batch_size, step, seed)]
