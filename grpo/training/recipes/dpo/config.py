"""The typed configuration of `grpo dpo`: its own groups of flags, and the groups it shares.

As `grpo sft`'s (`grpo.training.recipes.sft.config`): a record of its own, composed of the shared
groups of `grpo.training.settings.config_groups` (those of every recipe, and the data, evaluation
and schedule groups of every data recipe), and its own.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

import attrs

from grpo.core.dpo import DPO_LOSSES, DpoSettings
from grpo.training.recipes.sft.config import RECIPE_KEY, resolve_recipe_run
from grpo.training.settings.config_groups import (
    OptimizerSettings,
    ScheduleSettings,
    data_settings,
    evaluation_settings,
    recipe_groups,
)
from grpo.training.settings.fields import (
    NOT_EMPTY,
    Above,
    AtLeast,
    ConfigError,
    Field,
    Interval,
    OneOf,
    flag,
    grouped,
    with_checks,
)

DpoDataSettings = data_settings(
    "DpoDataSettings",
    rows="prompt/chosen/rejected rows",
    help="preference pairs: a .jsonl/.parquet/.csv file of 'prompt', 'chosen' and 'rejected' "
    "rows (docs/sft-dpo-distill.md, 'Preference training')",
)


@attrs.frozen(slots=False, field_transformer=grouped("run"))
class DpoStartSettings:
    """The weights DPO starts from, and its reference policy."""

    ref: str | None = flag(
        None,
        "reference policy: a finished run directory or a weights path (default: the "
        "--init-from run's final weights, else the base model)",
        NOT_EMPTY,
    )
    init_from: str | None = flag(
        None,
        "start from the final weights of a finished run directory (same backend, base model "
        "and LoRA rank); they are the reference too unless --ref",
        NOT_EMPTY,
    )


@attrs.frozen(slots=False, field_transformer=grouped("loss"))
class DpoLossSettings:
    """The per-pair loss and its β, ε and α (docs/FORMULAS.md)."""

    dpo_beta: float = flag(
        0.1, "β: scale of the implicit reward β·(log π − log π_ref) (docs/FORMULAS.md)", Above(0)
    )
    dpo_loss: str = flag("sigmoid", "per-pair loss: sigmoid (DPO), ipo or hinge", OneOf(DPO_LOSSES))
    label_smoothing: float = flag(
        0.0,
        "ε of conservative DPO: the share of pairs assumed mislabeled (sigmoid only; < 0.5)",
        Interval(0, 0.5, "left"),
    )
    sft_weight: float = flag(
        0.0, "α: weight of the SFT loss on the chosen completions (RPO; 0 = off)", AtLeast(0)
    )


@attrs.frozen(slots=False, field_transformer=grouped("update"))
class DpoUpdateSettings:
    """How many steps, of how many pairs."""

    steps: int = flag(0, "optimizer steps (0 = one pass over the training pairs)", AtLeast(0))
    batch_size: int = flag(16, "pairs per step (two datums each)", AtLeast(1))


DpoEvaluationSettings = evaluation_settings(
    "DpoEvaluationSettings", rows="pairs", measure="eval/dpo/*", every=5
)


@attrs.frozen(slots=False, field_transformer=grouped("service"))
class DpoServiceSettings:
    """The reference log-prob requests (once per run)."""

    concurrency: int = flag(
        32, "reference compute_logprobs requests in flight at once (once per run)", AtLeast(1)
    )


_LEARNING_RATE = attrs.fields_dict(OptimizerSettings)["learning_rate"]


@attrs.frozen(field_transformer=with_checks)
class DpoConfig(
    *recipe_groups(
        own=(DpoStartSettings, DpoDataSettings, DpoLossSettings, DpoUpdateSettings),
        evaluation=(ScheduleSettings, DpoEvaluationSettings),
        service=(DpoServiceSettings,),
    )
):
    """Every knob of `grpo dpo`; --data is required."""

    learning_rate: float = attrs.field(
        default=5e-4,
        validator=_LEARNING_RATE.validator,
        converter=_LEARNING_RATE.converter,
        metadata=_LEARNING_RATE.metadata,
    )
    """The shared --learning-rate with DPO's own default."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # --data is required (the data group's check)
        try:
            self.settings  # noqa: B018 - the check is the point
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def settings(self) -> DpoSettings:
        """β, the loss, ε and α as the core kernel takes them."""
        return DpoSettings(
            beta=self.dpo_beta,
            loss=self.dpo_loss,
            label_smoothing=self.label_smoothing,
            sft_weight=self.sft_weight,
        )


DPO_FIELDS: dict[str, Field] = attrs.fields_dict(DpoConfig)


def dpo_to_dict(config: DpoConfig) -> dict[str, object]:
    """The config as config.json holds it: its fields and ``recipe: "dpo"``."""
    return {**attrs.asdict(config), RECIPE_KEY: "dpo"}


def resolve_dpo_run(config: DpoConfig) -> DpoConfig:
    """Run name (--run-name, else the run directory's name, else dpo-seed<k>-<time>) and dir."""
    return resolve_recipe_run(config, "dpo")
