"""The typed configuration of `grpo dpo`: its own flags, and the ones it shares with `grpo train`.

As `grpo sft`'s (`grpo.training.sft_config`): a record of its own, the shared flags copied
from `TrainConfig`'s fields with their help and checks (`shared`).

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from typing import Any

import attrs

from grpo.core.dpo import DPO_LOSSES, DpoSettings
from grpo.core.sft import LR_SCHEDULES
from grpo.training.fields import (
    NOT_EMPTY,
    Above,
    AtLeast,
    ConfigError,
    Interval,
    OneOf,
    flag,
    with_checks,
)
from grpo.training.sft_config import RECIPE_KEY, resolve_recipe_run, shared


@attrs.frozen(field_transformer=with_checks)
class DpoConfig:
    """Every knob of `grpo dpo`; --data is required."""

    data: str | None = flag(
        None,
        "preference pairs: a .jsonl/.parquet/.csv file of 'prompt', 'chosen' and 'rejected' "
        "rows (README, Preference training)",
        NOT_EMPTY,
    )
    eval_data: str | None = flag(
        None, "held-out pairs for eval/dpo/* (default: --eval-fraction of --data)", NOT_EMPTY
    )
    eval_fraction: float = flag(
        0.1,
        "share of --data held out for eval/dpo/* when no --eval-data (0 = none)",
        Interval(0, 1, "left"),
    )
    steps: int = flag(0, "optimizer steps (0 = one pass over the training pairs)", AtLeast(0))
    batch_size: int = flag(16, "pairs per step (two datums each)", AtLeast(1))
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
    ref: str | None = flag(
        None,
        "reference policy: a finished run directory or a weights path (default: the "
        "--init-from run's final weights, else the base model)",
        NOT_EMPTY,
    )
    lr_schedule: str = flag(
        "linear", "learning-rate decay after the warm-up (docs/FORMULAS.md)", OneOf(LR_SCHEDULES)
    )
    warmup_steps: int = flag(0, "steps of linear learning-rate warm-up", AtLeast(0))
    eval_every: int = flag(
        5,
        "eval/dpo/* on the held-out pairs before training, every N steps and at the end "
        "(0 = never)",
        AtLeast(0),
    )
    concurrency: int = flag(
        32, "reference compute_logprobs requests in flight at once (once per run)", AtLeast(1)
    )
    init_from: str | None = flag(
        None,
        "start from the final weights of a finished run directory (same backend, base model "
        "and LoRA rank); they are the reference too unless --ref",
        NOT_EMPTY,
    )
    backend: str = shared("backend")
    base_model: str = shared("base_model")
    lora_rank: int = shared("lora_rank")
    learning_rate: float = shared("learning_rate", 5e-4)
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
            raise ConfigError(
                "--data is required: a .jsonl/.parquet/.csv file of prompt/chosen/rejected rows"
            )
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


DPO_FIELDS: dict[str, "attrs.Attribute[Any]"] = attrs.fields_dict(DpoConfig)


def dpo_to_dict(config: DpoConfig) -> dict[str, Any]:
    """The config as config.json holds it: its fields and ``recipe: "dpo"``."""
    return {**attrs.asdict(config), RECIPE_KEY: "dpo"}


def resolve_dpo_run(config: DpoConfig) -> DpoConfig:
    """Run name (--run-name, else the run directory's name, else dpo-seed<k>-<time>) and dir."""
    return resolve_recipe_run(config, "dpo")
