"""The typed configuration of `grpo sft`: its own flags, and the ones it shares with `grpo train`.

SFT has a record of its own rather than fields on `TrainConfig`: its flags (--data,
--batch-tokens, --lr-schedule ...) mean nothing to a GRPO run and must not appear in
`grpo train --help`, nor in the sweeps and TOML files that build a TrainConfig. The flags
both recipes have (model, backend, optimizer, seed, checkpoints, logging, prices) are
`TrainConfig`'s own fields, copied here with their help, type checks and validators
(`shared`), so each stays defined once, in `grpo.training.config`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import attrs

from grpo.core.sft import LR_SCHEDULES
from grpo.training.config import FIELDS as TRAIN_FIELDS
from grpo.training.fields import (
    NOT_EMPTY,
    AtLeast,
    ConfigError,
    Interval,
    OneOf,
    flag,
    with_checks,
)

_UNSET = object()


def shared(name: str, default: Any = _UNSET) -> Any:
    """TrainConfig's field ``name`` (help, type check, validators); its default or ``default``."""
    field = TRAIN_FIELDS[name]
    return attrs.field(
        default=field.default if default is _UNSET else default,
        validator=field.validator,
        converter=field.converter,
        metadata=field.metadata,
    )


@attrs.frozen(field_transformer=with_checks)
class SftConfig:
    """Every knob of `grpo sft`; --data is required."""

    data: str | None = flag(
        None,
        "training rows: a .jsonl/.parquet/.csv file of 'messages', 'prompt'+'completion' or "
        "'text' rows (README, Supervised fine-tuning)",
        NOT_EMPTY,
    )
    eval_data: str | None = flag(
        None, "held-out rows for the eval loss (default: --eval-fraction of --data)", NOT_EMPTY
    )
    eval_fraction: float = flag(
        0.1,
        "share of --data held out for the eval loss when no --eval-data (0 = none)",
        Interval(0, 1, "left"),
    )
    epochs: int = flag(1, "passes over the training rows", AtLeast(1))
    batch_tokens: int = flag(
        4096, "most tokens per batch (whole rows; one optimizer step per batch)", AtLeast(1)
    )
    lr_schedule: str = flag(
        "linear", "learning-rate decay after the warm-up (docs/FORMULAS.md)", OneOf(LR_SCHEDULES)
    )
    warmup_steps: int = flag(0, "steps of linear learning-rate warm-up", AtLeast(0))
    eval_every: int = flag(
        10,
        "eval loss on the held-out rows before training, every N steps and at the end (0 = never)",
        AtLeast(0),
    )
    backend: str = shared("backend")
    base_model: str = shared("base_model")
    lora_rank: int = shared("lora_rank")
    learning_rate: float = shared("learning_rate")
    beta1: float = shared("beta1")
    beta2: float = shared("beta2")
    eps: float = shared("eps")
    weight_decay: float = shared("weight_decay")
    grad_clip_norm: float = shared("grad_clip_norm")
    seed: int = shared("seed")
    save_every: int = shared("save_every")
    run_dir: str | None = shared("run_dir")
    run_name: str | None = shared("run_name")
    log_to: tuple[str, ...] = shared("log_to")
    swanlab_mode: str = shared("swanlab_mode")
    swanlab_project: str = shared("swanlab_project")
    tracker_group: str | None = shared("tracker_group")
    connect_timeout: float = shared("connect_timeout")
    threads: int = shared("threads")
    service_normalization: str | None = shared("service_normalization")
    max_retries: int = shared("max_retries")
    price_file: str | None = shared("price_file")
    price_prompt: float | None = shared("price_prompt")
    price_completion: float | None = shared("price_completion")
    price_train: float | None = shared("price_train")
    price_forward: float | None = shared("price_forward")
    price_currency: str | None = shared("price_currency")

    def __attrs_post_init__(self) -> None:
        if self.data is None:
            raise ConfigError("--data is required: a .jsonl/.parquet/.csv file of training rows")


SFT_FIELDS: dict[str, "attrs.Attribute[Any]"] = attrs.fields_dict(SftConfig)
RECIPE_KEY = "recipe"
"""config.json of an SFT run names its recipe (``"sft"``), so `grpo train` can tell it apart."""


RecipeConfig = TypeVar("RecipeConfig")


def recipe_config_from_dict(
    config_class: type[RecipeConfig], command: str, values: dict[str, Any], *, where: str
) -> RecipeConfig:
    """A recipe's config (SftConfig, DpoConfig) from flag values; ConfigError naming an
    unknown key, `grpo <command> --help` and `where`."""
    unknown = sorted(set(values) - set(attrs.fields_dict(config_class)))
    if unknown:
        raise ConfigError(
            f"{where}: unknown {command} flag {unknown[0]!r}; see `grpo {command} --help` for "
            "the flags"
        )
    try:
        return config_class(**values)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def sft_config_from_dict(values: dict[str, Any], *, where: str) -> SftConfig:
    """An SftConfig from flag values; ConfigError naming an unknown key and `where`."""
    return recipe_config_from_dict(SftConfig, "sft", values, where=where)


def sft_to_dict(config: SftConfig) -> dict[str, Any]:
    """The config as config.json holds it: its fields and ``recipe: "sft"``."""
    return {**attrs.asdict(config), RECIPE_KEY: "sft"}


def resolve_sft_run(config: SftConfig) -> SftConfig:
    """Run name (--run-name, else the run directory's name, else sft-seed<k>-<time>) and dir."""
    return resolve_recipe_run(config, "sft")


def resolve_recipe_run(config: Any, prefix: str) -> Any:
    """A recipe config (SFT, DPO) with its run name (--run-name, else the run directory's
    name, else <prefix>-seed<k>-<time>) and run directory (default runs/<run name>)."""
    directory_name = Path(config.run_dir).name if config.run_dir else ""
    if directory_name in (".", ".."):
        directory_name = ""
    run_name = (
        config.run_name
        or directory_name
        or f"{prefix}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    return attrs.evolve(config, run_name=run_name, run_dir=config.run_dir or f"runs/{run_name}")
