"""The flag groups of the data recipes (`grpo sft`, `grpo dpo`), each defined once.

A data recipe trains on the rows of a --data file and measures itself on held-out rows: the
same flags, checks and held-out split for every such recipe
(`grpo.training.recipes.sft.recipe.encoded_split`), whose help only names what its rows are.
So `data_settings` and `evaluation_settings` make a recipe's data group and evaluation group
from those words, and the learning-rate schedule is one group, `ScheduleSettings`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

import attrs

from grpo.core.sft import LR_SCHEDULES
from grpo.training.settings.fields import (
    NOT_EMPTY,
    AtLeast,
    ConfigError,
    Interval,
    OneOf,
    flag,
    grouped,
)


@attrs.frozen(slots=False, field_transformer=grouped("update"))
class ScheduleSettings:
    """The learning-rate schedule of the data recipes (SFT, DPO)."""

    lr_schedule: str = flag(
        "linear", "learning-rate decay after the warm-up (docs/FORMULAS.md)", OneOf(LR_SCHEDULES)
    )
    warmup_steps: int = flag(0, "steps of linear learning-rate warm-up", AtLeast(0))


def _named(group: type, name: str, doc: str) -> type:
    """`group`, a class made by a factory below, under the name and docstring of its recipe's."""
    group.__name__ = group.__qualname__ = name
    group.__doc__ = doc
    return group


def data_settings(name: str, *, rows: str, help: str) -> type:
    """The "data and task" group (class `name`) of a data recipe: --data, the file of its
    training `rows`, shown with `help`; building it without --data raises ConfigError."""

    @attrs.frozen(slots=False, field_transformer=grouped("data and task"))
    class DataSettings:
        data: str | None = flag(None, help, NOT_EMPTY)

        def __attrs_post_init__(self) -> None:
            if self.data is None:
                raise ConfigError(f"--data is required: a .jsonl/.parquet/.csv file of {rows}")

    return _named(DataSettings, name, f"The {rows} the recipe trains on; --data is required.")


def evaluation_settings(name: str, *, rows: str, measure: str, every: int) -> type:
    """The "evaluation and checkpoints" group (class `name`) of a data recipe: its held-out
    `rows` (--eval-data, else --eval-fraction of --data) and how often (--eval-every, default
    `every`) `measure` is measured on them ("the eval loss", "eval/dpo/*"; its help's words)."""

    @attrs.frozen(slots=False, field_transformer=grouped("evaluation and checkpoints"))
    class EvaluationSettings:
        eval_data: str | None = flag(
            None, f"held-out {rows} for {measure} (default: --eval-fraction of --data)", NOT_EMPTY
        )
        eval_fraction: float = flag(
            0.1,
            f"share of --data held out for {measure} when no --eval-data (0 = none)",
            Interval(0, 1, "left"),
        )
        eval_every: int = flag(
            every,
            f"{measure.removeprefix('the ')} on the held-out {rows} before training, every N "
            "steps and at the end (0 = never)",
            AtLeast(0),
        )

    return _named(
        EvaluationSettings, name, f"The held-out {rows} and how often {measure} is measured."
    )
