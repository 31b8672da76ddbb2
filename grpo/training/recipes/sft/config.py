"""The typed configuration of `grpo sft`: its own groups of flags, and the groups it shares.

SFT has a record of its own rather than fields on `TrainConfig`: its flags (--data,
--batch-tokens, --lr-schedule ...) mean nothing to a GRPO run and must not appear in
`grpo train --help`, nor in the sweeps and TOML files that build a TrainConfig. The flags
every recipe has (model, backend, optimizer, seed, checkpoints, logging, prices) come from
the shared groups of `grpo.training.settings.config_groups`, each defined once; so do its data,
evaluation and schedule groups, those of every data recipe, in its own words.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import attrs

from grpo.training.settings.config_groups import (
    RunSettings,
    ScheduleSettings,
    data_settings,
    evaluation_settings,
    recipe_groups,
)
from grpo.training.settings.fields import (
    AtLeast,
    ConfigError,
    Field,
    flag,
    grouped,
    with_checks,
)

SftDataSettings = data_settings(
    "SftDataSettings",
    rows="training rows",
    help="training rows: a .jsonl/.parquet/.csv file of 'messages', 'prompt'+'completion' or "
    "'text' rows (docs/sft-dpo-distill.md, 'Supervised fine-tuning')",
)


@attrs.frozen(slots=False, field_transformer=grouped("update"))
class SftUpdateSettings:
    """How many passes, in batches of how many tokens."""

    epochs: int = flag(1, "passes over the training rows", AtLeast(1))
    batch_tokens: int = flag(
        4096, "most tokens per batch (whole rows; one optimizer step per batch)", AtLeast(1)
    )


SftEvaluationSettings = evaluation_settings(
    "SftEvaluationSettings", rows="rows", measure="the eval loss", every=10
)


@attrs.frozen(field_transformer=with_checks)
class SftConfig(
    *recipe_groups(
        own=(SftDataSettings, SftUpdateSettings),
        evaluation=(ScheduleSettings, SftEvaluationSettings),
    )
):
    """Every knob of `grpo sft`; --data is required."""


SFT_FIELDS: dict[str, Field] = attrs.fields_dict(SftConfig)
RECIPE_KEY = "recipe"
"""config.json of an SFT run names its recipe (``"sft"``), so `grpo train` can tell it apart."""


RecipeConfig = TypeVar("RecipeConfig")


def recipe_config_from_dict(
    config_class: type[RecipeConfig], command: str, values: Mapping[str, object], *, where: str
) -> RecipeConfig:
    """A recipe's config (SftConfig, ...) from flag values; ConfigError naming an
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


def sft_to_dict(config: SftConfig) -> dict[str, object]:
    """The config as config.json holds it: its fields and ``recipe: "sft"``."""
    return {**attrs.asdict(config), RECIPE_KEY: "sft"}


def resolve_sft_run(config: SftConfig) -> SftConfig:
    """Run name (--run-name, else the run directory's name, else sft-seed<k>-<time>) and dir."""
    return resolve_recipe_run(config, "sft")


Run = TypeVar("Run", bound=RunSettings)


def resolve_recipe_run(config: Run, prefix: str) -> Run:
    """A data recipe's config (SFT, ...) with its run name (--run-name, else the run directory's
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
