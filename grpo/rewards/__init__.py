"""Reward functions named on the command line: loading, checking and scoring completions.

A reward is a Python callable of the completion text and the dataset row (a dict of the
row's columns), returning a float or a dict of named floats:

    def short_answer(completion: str, row: dict) -> float: ...
    def graded(completion: str, row: dict, sample: RewardInput) -> dict[str, float]: ...

An optional third positional parameter receives a `grpo.core.rewards.RewardInput` (row
index, gold answer, token length, stop reason, max tokens, overlong buffer). `--reward`
names one as `module:function` or `path/to/file.py:function`, optionally `=WEIGHT`
(default 1); it repeats, and the step's reward is the weighted sum of the components. A
float reward is component `<function>`, a dict's entries are `<function>/<key>`; each is
logged as `reward/<component>`. Built-ins live in this module: `boxed_match` (the default,
today's grading), `boxed_format` and `overlong_penalty` (DAPO's, with --overlong-buffer);
`math_verify` (LaTeX answers by math-verify, `grpo/rewards/math_grading.py`) and
`code_tests` / `code_tests_partial` (the completion's code run against the row's `tests`
in a sandbox, `grpo/sandbox.py`).

A reward that raises or returns NaN, infinity or a non-number raises `RewardError` naming
the row index and the completion (`--reward-errors stop`, the run then stops with a
checkpoint), or scores 0 for that component and is counted in `reward/errors`
(`--reward-errors zero`); so does a call past `--reward-timeout`. A reward that raises
SystemExit or KeyboardInterrupt raises `RewardExit` (the run stops with a checkpoint).
Built-ins run in this process (`--reward-workers N`: on N threads); user plugins run in
worker processes with a timeout, each call on its own copy of the row
(`grpo/rewards/calls.py`); `grpo/rewards/scores.py` scores a step's completions through them.
Results are collected in completion order, so they equal the serial ones.

Judge rewards (`judge`, `judge_rank`; docs/FORMULAS.md, "Judge rewards") are called once per
step with every group and the run's judge (`--judge-model`, `--judge-url`;
`grpo/rewards/judges.py`), always in this process: the judge has its own pool, timeouts and
retries. `judge` scores each completion against the rubric, `judge_rank` has the judge rank
each group's completions against each other. A reply that does not parse, or a judge call
that kept failing, is a failed call like any reward's (`--reward-errors`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from grpo.core.rewards import (
    RewardInput,
    boxed_format,
    boxed_match,
    extract_boxed,
    overlong_penalty,
)
from grpo.plugins import load_callable
from grpo.rewards.code_grading import pass_fraction
from grpo.rewards.math_grading import math_gold, verify_pooled

__all__ = [
    "DEFAULT_REWARD",
    "RewardError",
    "RewardExit",
    "RewardFn",
    "boxed_format",
    "boxed_match",
    "checked_values",
    "code_tests",
    "judge",
    "judge_rank",
    "code_tests_partial",
    "load_rewards",
    "math_verify",
    "overlong_penalty",
    "parse_reward_spec",
]

DEFAULT_REWARD = "grpo.rewards:boxed_match"
ERROR_MODES = ("stop", "zero")


class RewardError(ValueError):
    """A reward callable that raised, timed out or returned something not a finite number."""


class RewardExit(RuntimeError):
    """A reward raised SystemExit or KeyboardInterrupt: the run stops with a checkpoint."""


def math_verify(completion: str, row: Mapping[str, Any], sample: RewardInput) -> float:
    """1.0 when math-verify finds the last `\\boxed{}` answer equal to the row's gold, else 0.0.

    The gold is the last boxed answer of a MATH-style `solution` column, else the answer
    --gold-rule extracted; a call past the timeout scores 0 (`grpo/rewards/math_grading.py`).
    """
    answer = extract_boxed(completion)
    if answer is None or not answer.strip():
        return 0.0
    return verify_pooled(answer, math_gold(row, sample.gold))


def code_tests(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 when the last fenced Python block passes every assert of the row's `tests`, else 0.0."""
    return float(pass_fraction(completion, row) == 1.0)


def code_tests_partial(completion: str, row: Mapping[str, Any]) -> float:
    """The fraction of the row's `tests` asserts the last fenced Python block passes."""
    return pass_fraction(completion, row)


JUDGE_MODE_ATTRIBUTE = "grpo_judge_mode"


def judge(groups: Sequence[Any], judge_client: Any) -> list[list[Any]]:
    """s / S of each completion's judged `SCORE: s` line (one judge call per completion).

    Called with the step's groups (`grpo.rewards.judges.JudgeGroup`) and the run's judge;
    returns per group, per completion, the reward or the exception that stands for a failed
    call (a reply that does not parse, a request that kept failing).
    """
    return judge_client.score_groups(groups)


def judge_rank(groups: Sequence[Any], judge_client: Any) -> list[list[Any]]:
    """(G - rho_i) / (G - 1) of each completion's fractional rank rho_i in its group's ranking
    by the judge (one judge call per group; docs/FORMULAS.md, "Judge rewards")."""
    return judge_client.rank_groups(groups)


setattr(judge, JUDGE_MODE_ATTRIBUTE, "score")
setattr(judge_rank, JUDGE_MODE_ATTRIBUTE, "rank")


@attrs.frozen
class RewardFn:
    """One loaded reward: its spec, name, weight, the callable, whether it takes `sample`, and
    its judge mode ("score", "rank"; None for a reward of the text alone)."""

    spec: str
    name: str
    weight: float
    fn: Callable[..., Any] = attrs.field(eq=False)
    takes_sample: bool
    judge_mode: str | None = None

    def __call__(self, completion: str, row: Mapping[str, Any], sample: RewardInput) -> Any:
        """The callable's raw value for one completion."""
        if self.takes_sample:
            return self.fn(completion, row, sample)
        return self.fn(completion, row)


MAX_REWARD = 1e12
"""The largest |value| a reward may return: totals, means and variances of G such values stay
finite (1e308 + 1e308 is inf, and so is any variance over 1e154)."""
MAX_WEIGHT = 1e6


def parse_reward_spec(spec: str) -> tuple[str, str, float]:
    """`target:function[=weight]` -> (target, function, weight); ValueError naming the fix."""
    example = "e.g. --reward grpo.rewards:boxed_match or --reward my_rewards.py:short=0.2"
    body, sep, raw_weight = spec.rpartition("=")
    if not sep:
        body, raw_weight = spec, "1"
    try:
        weight = float(raw_weight)
    except ValueError:
        raise ValueError(
            f"--reward {spec!r}: weight {raw_weight!r} is not a number; {example}"
        ) from None
    if not math.isfinite(weight) or abs(weight) > MAX_WEIGHT:
        raise ValueError(
            f"--reward {spec!r}: weight must be a finite number within ±{MAX_WEIGHT:g}, got "
            f"{raw_weight!r}"
        )
    target, colon, function = body.rpartition(":")
    if not colon or not target.strip() or not function.strip():
        raise ValueError(f"--reward {spec!r} must look like MODULE:FUNCTION[=WEIGHT]; {example}")
    if not function.isidentifier():
        raise ValueError(f"--reward {spec!r}: {function!r} is not a Python function name")
    return target.strip(), function.strip(), weight


def _takes_sample(spec: str, fn: Callable[..., Any]) -> bool:
    """Whether `fn` is called as fn(completion, row, sample) (else fn(completion, row))."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    for arguments in (("", {}, None), ("", {})):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return len(arguments) == 3
    raise ValueError(
        f"--reward {spec!r}: {getattr(fn, '__name__', fn)}{signature} must accept "
        "(completion, row) or (completion, row, sample)"
    )


def load_rewards(specs: Sequence[str]) -> tuple[RewardFn, ...]:
    """Every `--reward` loaded and checked (the default reward when none is given)."""
    loaded = []
    for spec in specs or (DEFAULT_REWARD,):
        target, function, weight = parse_reward_spec(spec)
        fn = load_callable("--reward", spec, target, function, namespace="reward")
        mode = getattr(fn, JUDGE_MODE_ATTRIBUTE, None)
        if mode is not None:
            loaded.append(
                RewardFn(
                    spec=spec,
                    name=function,
                    weight=weight,
                    fn=fn,
                    takes_sample=False,
                    judge_mode=str(mode),
                )
            )
            continue
        loaded.append(
            RewardFn(
                spec=spec, name=function, weight=weight, fn=fn, takes_sample=_takes_sample(spec, fn)
            )
        )
    names = [reward.name for reward in loaded]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"--reward names {duplicates[0]!r} twice; give each reward once (one weight each)"
        )
    return tuple(loaded)


def checked_values(reward: RewardFn, value: Any) -> dict[str, float] | str:
    """The named values of one call, or why the value is not a finite number (or dict of them)."""
    items = value.items() if isinstance(value, Mapping) else [(None, value)]
    checked: dict[str, float] = {}
    for key, item in items:
        name = reward.name if key is None else f"{reward.name}/{key}"
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            return f"returned {item!r} ({type(item).__name__}) for {name}, not a number"
        if not math.isfinite(float(item)):
            return f"returned {float(item)!r} for {name}, not a finite number"
        if abs(float(item)) > MAX_REWARD:
            return (
                f"returned {float(item)!r} for {name}, beyond the bound of ±{MAX_REWARD:g} (sums "
                "and variances of such values overflow); scale the reward down"
            )
        checked[name] = float(item)
    if not checked:
        return "returned an empty dict"
    return checked
