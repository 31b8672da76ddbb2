"""The groups of flags every recipe shares, each defined once: model, run, service, update,
checkpoints and prices; and those every data recipe (sft, dpo) shares: its data, evaluation and
learning-rate schedule.

A recipe's configuration (`TrainConfig` for grpo and distill, `SftConfig`, ...) is
composed of these groups and of its own (`grpo.training.settings.train_groups` for grpo and
distill), so a shared flag's name, type, default, help and checks live here once. Each group is an
attrs record of its own (`grouped` gives each field its strict type check and its `--help`
group), usable alone: `OptimizerSettings(learning_rate=1e-4)`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from collections.abc import Sequence
from typing import Protocol

import attrs

from grpo.backends.names import TINY_MODEL_NAME
from grpo.core.normalization import NORMALIZATIONS
from grpo.core.sft import LR_SCHEDULES
from grpo.training.settings.fields import (
    NOT_EMPTY,
    PLAIN_NAME,
    TRACKER_LIST,
    Above,
    AtLeast,
    ConfigError,
    InRange,
    Interval,
    OneOf,
    flag,
    grouped,
    price_flag,
)

BACKENDS = ("local", "pytrio", "tinker")
SWANLAB_MODES = ("online", "offline", "disabled")
# PyTRIO's `create_lora_training_client` accepts ranks 4..64 (pytrio/client/service.py);
# the local backend enforces the same range.
LORA_RANKS = range(4, 65)
# numpy's SeedSequence needs seeds >= 0 and the samplers take 31-bit seeds.
SEEDS = range(0, 2**31)


@attrs.frozen(slots=False, field_transformer=grouped("run"))
class ModelSettings:
    """Which model trains, and where."""

    backend: str = flag(
        "local",
        "where training runs: the embedded local model or the PyTRIO service",
        OneOf(BACKENDS),
    )
    base_model: str = flag(
        TINY_MODEL_NAME,
        "base model name (PyTRIO catalog id, the built-in tiny model, or a local HF directory)",
        NOT_EMPTY,
    )
    lora_rank: int = flag(
        32, f"LoRA rank ({LORA_RANKS.start}..{LORA_RANKS.stop - 1})", InRange(LORA_RANKS)
    )


@attrs.frozen(slots=False, field_transformer=grouped("run"))
class RunSettings:
    """The run's seed, its directory and name, and where its metrics go."""

    seed: int = flag(
        0, f"seed for data order, sampling and LoRA init (0..{SEEDS.stop - 1})", InRange(SEEDS)
    )
    run_dir: str | None = flag(None, "run directory (default: runs/<run name>)", NOT_EMPTY)
    run_name: str | None = flag(
        None,
        "run name (default: the run directory's name, else derived from loss, seed and time)",
        PLAIN_NAME,
    )
    log_to: tuple[str, ...] = flag(
        ("swanlab",),
        "experiment tracker (repeatable): swanlab (in --swanlab-mode), wandb, tensorboard, "
        "trackio, or none; metrics.jsonl is always written "
        "(docs/training.md, 'Experiment tracking')",
        TRACKER_LIST,
        metavar="TRACKER",
    )
    swanlab_mode: str = flag("disabled", "SwanLab logging mode", OneOf(SWANLAB_MODES))
    swanlab_project: str = flag(
        "grpo", "project name in SwanLab, and in W&B and Trackio too", NOT_EMPTY
    )
    tracker_group: str | None = flag(
        None,
        "the group of this run in the trackers (W&B group, Trackio group); `grpo compare` and "
        "`grpo sweep` set it to the experiment directory's name",
        NOT_EMPTY,
    )


@attrs.frozen(slots=False, field_transformer=grouped("service"))
class ServiceSettings:
    """How the backend is reached and run: time-outs, retries, threads, normalization."""

    threads: int = flag(
        0,
        "local backend: torch intra-op threads of its worker (0 = auto: 1 for small models "
        "such as the built-in one, every core for large ones; OMP_NUM_THREADS or "
        "torch.set_num_threads, when set, are left alone)",
        AtLeast(0),
    )
    service_normalization: str | None = flag(
        None,
        "what the trainer divides a loss's gradient by: nothing (sum) or the request's active "
        "tokens, advantage tokens or samples; the loop pre-scales its datums for it, so the "
        "gradient applied is the loss's either way (docs/FORMULAS.md). Local backend: what "
        "it divides by; --backend pytrio: what the service is taken to divide by (default: "
        "sum on the local backend; on pytrio the probe's verdict, else samples)",
        OneOf(NORMALIZATIONS, none_ok=True),
    )
    connect_timeout: float = flag(
        30.0, "seconds to wait for the PyTRIO service to answer before giving up", Above(0)
    )
    max_retries: int = flag(
        3,
        "retries of a failed sampling/training call before the run stops with a checkpoint",
        AtLeast(0),
    )


@attrs.frozen(slots=False, field_transformer=grouped("update"))
class OptimizerSettings:
    """Adam(W) and the gradient clip."""

    learning_rate: float = flag(2e-4, "Adam learning rate", Above(0))
    beta1: float = flag(0.9, "Adam beta1", Interval(0, 1, "left"))
    beta2: float = flag(0.95, "Adam beta2", Interval(0, 1, "left"))
    eps: float = flag(1e-8, "Adam epsilon", Above(0))
    weight_decay: float = flag(0.0, "AdamW weight decay", AtLeast(0))
    grad_clip_norm: float = flag(1.0, "global gradient-norm clip (0 = off)", AtLeast(0))


@attrs.frozen(slots=False, field_transformer=grouped("evaluation and checkpoints"))
class CheckpointSettings:
    """How often the run saves a resumable checkpoint."""

    save_every: int = flag(
        20, "save a resumable checkpoint every N steps (0 = only at the end)", AtLeast(0)
    )


@attrs.frozen(slots=False, field_transformer=grouped("prices"))
class PriceSettings:
    """Prices per million tokens (none built in: a cost is shown only for prices given)."""

    price_file: str | None = flag(
        None,
        "TOML file of prices per million tokens, per model (docs/training.md, 'Cost')",
        NOT_EMPTY,
    )
    price_prompt: float | None = price_flag(
        "price per million prompt tokens sent to the sampler (overrides the file)"
    )
    price_completion: float | None = price_flag(
        "price per million sampled completion tokens (overrides the file)"
    )
    price_train: float | None = price_flag(
        "price per million trained tokens (positions x passes; overrides the file)"
    )
    price_forward: float | None = price_flag(
        "price per million forward-only tokens (default: the train price)"
    )
    price_currency: str | None = flag(
        None, "currency of the prices (overrides the file's; e.g. CNY)", NOT_EMPTY
    )


SHARED_GROUPS = (
    ModelSettings,
    RunSettings,
    ServiceSettings,
    OptimizerSettings,
    CheckpointSettings,
    PriceSettings,
)
"""The groups every recipe's config is composed of."""


def recipe_groups(
    *,
    before_run: Sequence[type] = (),
    own: Sequence[type],
    evaluation: Sequence[type],
    service: Sequence[type] = (),
) -> tuple[type, ...]:
    """The bases of a recipe's config class: the shared groups, with the recipe's own groups
    in their places, last-shown-first (attrs collects a class's fields from its last base to
    its first), so that every recipe's config.json and `--help` put the shared flags alike:
    model, `before_run`, run, `own`, update, `evaluation`, checkpoints, service, `service`,
    prices."""
    shown = (
        ModelSettings,
        *before_run,
        RunSettings,
        *own,
        OptimizerSettings,
        *evaluation,
        CheckpointSettings,
        ServiceSettings,
        *service,
        PriceSettings,
    )
    return tuple(reversed(shown))


# --- the groups of the data recipes ------------------------------------------------------
# A data recipe (`grpo sft`, `grpo dpo`) trains on the rows of a --data file and measures
# itself on held-out rows: the same flags, checks and held-out split for each
# (`grpo.training.recipes.sft.recipe.encoded_split`), whose help only names what its rows are.
# So `data_settings` and `evaluation_settings` make a data recipe's data and evaluation groups
# from those words; the learning-rate schedule is one group.


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


class RunConfig(Protocol):
    """What the shell reads of any recipe's config (`TrainConfig` and each data recipe's,
    composed of the groups above): the model and LoRA to open, the seed, the backend's
    divisor flag, time-out and threads, and the run's name and trackers."""

    @property
    def backend(self) -> str: ...

    @property
    def base_model(self) -> str: ...

    @property
    def lora_rank(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def service_normalization(self) -> str | None: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def threads(self) -> int: ...

    @property
    def run_name(self) -> str | None: ...

    @property
    def log_to(self) -> tuple[str, ...]: ...

    @property
    def swanlab_mode(self) -> str: ...

    @property
    def swanlab_project(self) -> str: ...

    @property
    def tracker_group(self) -> str | None: ...
