"""Scoring a step's completions: every --reward called (through the run's workers), grouped.

``score_completions`` calls each reward of each completion through a `RewardCaller`
(`grpo/rewards/calls.py`: threads or worker processes, timeouts), turns a failed, timed-out
or exiting call into an error or a counted 0 (--reward-errors), and returns the weighted
totals and every component per group (`RewardScores`). The rewards themselves, their specs
and their checks are `grpo/rewards/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from grpo.core.judging import JudgeGroup
from grpo.core.rewards import RewardInput, weighted_total
from grpo.rewards import RewardError, RewardExit, RewardFn, checked_values
from grpo.rewards.calls import CallExited, CallFailed, CallTimedOut, Result, RewardCaller

__all__ = ["RewardScores", "score_completions"]

_TEXT_PREVIEW = 300


@attrs.frozen
class RewardScores:
    """Rewards of one step's groups: the weighted totals and every component, per group."""

    totals_P: list[np.ndarray]
    components_P: list[dict[str, np.ndarray]]
    weights: dict[str, float]
    errors: int

    def extended(self, more: RewardScores) -> RewardScores:
        """These groups followed by those of `more` (another sampling round of the step)."""
        return RewardScores(
            totals_P=[*self.totals_P, *more.totals_P],
            components_P=[*self.components_P, *more.components_P],
            weights={**self.weights, **more.weights},
            errors=self.errors + more.errors,
        )

    def metrics(self) -> dict[str, float]:
        """`reward/<component>`: the mean of each (unweighted) component over all completions.

        A completion without a value for a component (a failed call) counts as 0, as it does
        in the total; `reward/errors` counts the failed calls.
        """
        metrics = {}
        for name in self.weights:
            values = [
                group.get(name, np.zeros(total.size))
                for group, total in zip(self.components_P, self.totals_P, strict=True)
            ]
            metrics[f"reward/{name}"] = float(np.mean(np.concatenate(values)))
        metrics["reward/errors"] = float(self.errors)
        return metrics


def _preview(text: str) -> str:
    return text if len(text) <= _TEXT_PREVIEW else text[:_TEXT_PREVIEW] + "..."


def _judge_results(
    reward: RewardFn,
    items: Sequence[tuple[str, Mapping[str, Any], RewardInput]],
    group_sizes: Sequence[int],
    caller: RewardCaller,
) -> list[Result]:
    """A judge reward's result for every item: its checked value, or the failed call."""
    if caller.judge is None:
        raise RewardError(
            f"reward {reward.spec!r} needs the run's judge (--judge-model, --judge-url); "
            "judge rewards are scored inside `grpo train`"
        )
    cuts = np.cumsum([0, *group_sizes])
    groups = [
        JudgeGroup(
            row=items[start][1],
            completions=tuple(completion for completion, _row, _sample in items[start:stop]),
            samples=tuple(sample for _completion, _row, sample in items[start:stop]),
        )
        for start, stop in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    values = reward.fn(groups, caller.judge)
    results: list[Result] = []
    for value in (value for group in values for value in group):
        if isinstance(value, BaseException):
            results.append(CallFailed(f"got no judgement: {value}"))
            continue
        checked = checked_values(reward, value)
        results.append(CallFailed(checked) if isinstance(checked, str) else checked)
    return results


def score_completions(
    rewards: Sequence[RewardFn],
    items: Sequence[tuple[str, Mapping[str, Any], RewardInput]],
    group_sizes: Sequence[int],
    *,
    on_error: str = "stop",
    workers: int = 0,
    timeout: float = 0.0,
    caller: RewardCaller | None = None,
) -> RewardScores:
    """Every reward of every (completion, row, sample), grouped, with the weighted totals.

    The components are the union of the names returned, in order of first appearance; a
    completion that lacks one (a failed call under on_error="zero", a dict without that key)
    scores 0 for it. Calls go through `caller` (the run's, `grpo/rewards/calls.py`), else a
    caller made for this call from `workers` and `timeout`. A call that raised SystemExit or
    KeyboardInterrupt raises `RewardExit`; one past the timeout is an error like a raise.
    """
    calls = [(which, item) for item in items for which in range(len(rewards))]
    judged = [which for which, reward in enumerate(rewards) if reward.judge_mode is not None]
    plain = [(position, call) for position, call in enumerate(calls) if call[0] not in judged]
    own = caller is None
    if caller is None:
        caller = RewardCaller(rewards, workers=workers, timeout=timeout)
    results: list[Any] = [None] * len(calls)
    try:
        for (position, _call), result in zip(
            plain, caller.results([call for _position, call in plain]), strict=True
        ):
            results[position] = result
    finally:
        if own:
            caller.close()
    for which in judged:
        for index, result in enumerate(_judge_results(rewards[which], items, group_sizes, caller)):
            results[index * len(rewards) + which] = result
    weights: dict[str, float] = {}
    values: list[dict[str, float]] = [{} for _ in items]
    errors = 0
    for position, ((which, (completion, _row, sample)), result) in enumerate(
        zip(calls, results, strict=True)
    ):
        reward = rewards[which]
        where = f"on row {sample.index} for the completion {_preview(completion)!r}"
        if isinstance(result, CallExited):
            raise RewardExit(
                f"reward {reward.spec!r} {result.why} {where}; a reward may not end the run: "
                "return a number (or raise an exception, see --reward-errors)"
            )
        if isinstance(result, CallTimedOut) and on_error == "stop":
            raise RewardError(
                f"reward {reward.spec!r} did not return within --reward-timeout "
                f"{result.seconds:g}s {where}; make it faster, raise --reward-timeout, or pass "
                "--reward-errors zero to score such calls 0"
            )
        if isinstance(result, CallTimedOut):
            if caller.note is not None:
                caller.note(
                    f"reward {reward.spec!r} timed out after {result.seconds:g}s on row "
                    f"{sample.index}; scored 0 (--reward-errors zero)"
                )
            errors += 1
            continue
        if isinstance(result, CallFailed):
            if on_error == "stop":
                fix = (
                    "use a judge that answers in the rubric's format"
                    if reward.judge_mode is not None
                    else "fix the reward"
                )
                raise RewardError(
                    f"reward {reward.spec!r} {result.why} {where}; {fix}, or pass "
                    "--reward-errors zero to score such cases 0"
                )
            errors += 1
            continue
        for name, value in result.items():
            weights.setdefault(name, reward.weight)
            values[position // len(rewards)][name] = value
    columns = {name: np.array([v.get(name, 0.0) for v in values]) for name in weights}
    totals = weighted_total(columns, weights) if columns else np.zeros(len(items))
    cuts = np.cumsum(group_sizes)[:-1]
    totals_P = np.split(totals, cuts)
    split_columns = {name: np.split(column, cuts) for name, column in columns.items()}
    components_P = [
        {name: split_columns[name][g] for name in weights} for g in range(len(group_sizes))
    ]
    return RewardScores(
        totals_P=totals_P, components_P=components_P, weights=weights, errors=errors
    )
