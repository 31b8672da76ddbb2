"""The typed configuration of a GRPO or distill run: one field per `grpo train` flag.

The CLI, TOML config files, a run's saved `config.json`, `grpo compare` and `grpo sweep` all
build this one class. It is composed of groups of flags, each defined once: the groups every
recipe shares (`grpo.training.settings.config_groups`: model, run, service, update, checkpoints,
prices) and those of grpo and distill (`grpo.training.settings.train_groups`: data, rewards,
sampling, loss, KL, mismatch, environments, judge, teacher, evaluation). Field `foo_bar` is
flag `--foo-bar` and a flat attribute (`config.kl_coef`); a concern is also a nested record
with its own checks (`config.kl`, `config.judge`, `config.environment`, `config.distillation`,
`config.prices`, `config.loss`, `config.mismatch_settings`). config.json holds the flat
fields, as it always has.

Building a `TrainConfig` checks everything that needs no data and no model (types, ranges,
finiteness, names from the registries of `grpo.core`, the loss and its config, each concern
group, the combinations across groups) and raises `ConfigError` naming the flag, the value
and the fix, so a bad flag never fails after a step ran. Building one reads no user data: the
--reward modules and the --fewshot-file are loaded by `check_user_inputs`, the first step of
the pre-flight (`grpo.training.recipes.grpo.plan.preflight`). The validators live in
`grpo.training.settings.fields`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from grpo.backends.names import BUILTIN_MODEL_NAMES
from grpo.training.settings.config_groups import (
    BACKENDS,
    LORA_RANKS,
    SEEDS,
    SWANLAB_MODES,
    PriceSettings,
    recipe_groups,
)
from grpo.training.settings.fields import (
    ConfigError,
    Field,
    flag_name,
    parse_loss_config,
    with_checks,
)
from grpo.training.settings.train_groups import (
    RECIPES,
    SAMPLER_DTYPES,
    DataSettings,
    EnvSettings,
    EvaluationSettings,
    JudgeSettings,
    KlSettings,
    LocalServiceSettings,
    LossSettings,
    MismatchSettings,
    RewardSettings,
    SamplingSettings,
    TeacherSettings,
    TrainRunSettings,
    UpdateSettings,
)

if TYPE_CHECKING:
    from grpo.core.loss_spec import LossSpec
    from grpo.core.mismatch import MismatchCorrection
    from grpo.envs.base import EnvFactory
    from grpo.rewards import RewardFn
    from grpo.tasks.prompts import PromptTemplate

__all__ = [
    "BACKENDS",
    "LORA_RANKS",
    "RECIPES",
    "SAMPLER_DTYPES",
    "SEEDS",
    "SWANLAB_MODES",
    "ConfigError",
    "TrainConfig",
    "parse_loss_config",
]

SERVICE_BACKENDS = ("pytrio", "tinker")
"""The backends that are services: their built-in losses only sum, through an SDK."""
TINKER_MASKED_BUILTINS = ("importance_sampling", "ppo", "cispo", "cross_entropy")
"""Tinker's built-in losses that are 0 wherever the weight input (advantage) is 0, so that
advantage 0 masks a token out as grpo's mask does; dro, whose penalty is not, runs as a
custom loss on --backend tinker."""

Group = TypeVar("Group")


# --- the configuration -------------------------------------------------------------------


def group_of(config: object, kind: type[Group]) -> Group:
    """The record of group `kind` holding `config`'s values of its fields (its checks run)."""
    return kind(**{name: getattr(config, name) for name in attrs.fields_dict(kind)})


def concern(kind: type[Group]) -> "cached_property[Group]":
    """A config's property: its concern `kind` as a record of its own (`group_of`), built and
    checked on first read, then kept."""
    return cached_property(lambda config: group_of(config, kind))


@attrs.frozen(field_transformer=with_checks)
class TrainConfig(
    *recipe_groups(
        before_run=(TrainRunSettings,),
        own=(
            DataSettings,
            SamplingSettings,
            RewardSettings,
            JudgeSettings,
            EnvSettings,
            LossSettings,
            KlSettings,
            MismatchSettings,
            TeacherSettings,
            UpdateSettings,
        ),
        evaluation=(EvaluationSettings,),
        service=(LocalServiceSettings,),
    )
):
    """Every knob of `grpo train`; defaults give the offline default run on the local backend."""

    def __attrs_post_init__(self) -> None:
        # Each concern's record, built once here, runs that group's own checks.
        _ = (self.loss, self.kl, self.mismatch_settings, self.environment, self.judge)
        _ = (self.distillation, self.prices)
        check_combinations(self)
        _ = self.loss_spec  # builds (and checks) the loss once, at construction
        _ = self.mismatch  # checks the correction against the loss
        if self.sampler_dtype != "float32" and self.backend != "local":
            raise ConfigError(
                f"--sampler-dtype {self.sampler_dtype} needs --backend local (a service's "
                "sampler precision is the service's); drop the flag or use --backend local"
            )

    loss = concern(LossSettings)
    """--advantage, --loss-fn, --loss-config, --custom-loss, --reduction, the CISPO bounds."""
    kl = concern(KlSettings)
    """--kl-coef and --kl-estimator."""
    mismatch_settings = concern(MismatchSettings)
    """--mismatch-correction and its cap and mask bounds, as given (`mismatch`: built)."""
    environment = concern(EnvSettings)
    """--env, its arguments, capacity, turns, time-out and error policy."""
    judge = concern(JudgeSettings)
    """The --judge-* flags."""
    distillation = concern(TeacherSettings)
    """--recipe, --teacher and the distill-* flags."""
    prices = concern(PriceSettings)
    """The --price-* flags."""

    @cached_property
    def reward_fns(self) -> tuple["RewardFn", ...]:
        """The loaded --reward callables (grpo.rewards:boxed_match when none is given).

        Imported on first read, never at construction (`check_user_inputs` reads it first).
        """
        from grpo.rewards import load_rewards

        try:
            return load_rewards(self.reward)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @cached_property
    def env_factory(self) -> "EnvFactory":
        """The loaded --env factory (read on first use, never at construction)."""
        from grpo.envs.base import load_env_factory

        if self.env is None:
            raise ConfigError("no --env given; this run samples single completions")
        try:
            if self.env.startswith("openenv:"):
                from grpo.envs.openenv import openenv_factory

                return openenv_factory(
                    self.env,
                    self.env_arg,
                    timeout_s=self.env_timeout,
                    max_retries=self.max_retries,
                    capacity=self.env_capacity,
                    concurrency=self.concurrency,
                )
            return load_env_factory(self.env)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @cached_property
    def prompt_template(self) -> "PromptTemplate":
        """--system-prompt, --question-suffix and the few-shot messages (--fewshot-file, read on
        first use, never at construction)."""
        from grpo.tasks.prompts import PromptTemplate

        try:
            return PromptTemplate.build(
                system_prompt=self.system_prompt,
                question_suffix=self.question_suffix,
                fewshot_file=self.fewshot_file,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def overlong_tokens(self) -> int:
        """L of the overlong penalty: --overlong-buffer, else --max-tokens // 4 (at least 1)."""
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        return max(1, self.max_tokens // 4)

    @cached_property
    def mismatch(self) -> "MismatchCorrection":
        """The validated --mismatch-correction with its cap and mask bounds."""
        return self.mismatch_settings.correction(self.loss_fn)

    @cached_property
    def loss_spec(self) -> "LossSpec":
        """The validated loss: --loss-fn, --loss-config (the CISPO flags folded in), --reduction.

        norm_length comes from `--loss-config norm_length=L`, else --max-tokens when the
        reduction is seq_mean_token_sum_norm (the constant L of docs/FORMULAS.md).
        """
        return self.loss.spec(self.max_tokens)

    @property
    def runs_custom_loss(self) -> bool:
        """Whether the loss runs client-side through forward_backward_custom.

        Asked for (--custom-loss), a kernel PyTRIO lacks, a non-sum reduction on a service
        (their built-in losses only sum; the local backend reduces any way itself), or on
        Tinker a loss that is not 0 where the advantage is (dro: Tinker has no mask input, so
        its built-in would also train the prompt and every zero-advantage token).
        """
        return (
            self.custom_loss
            or not self.loss_spec.kernel.service_builtin
            or (self.backend in SERVICE_BACKENDS and self.reduction != "sum")
            or (self.backend == "tinker" and self.loss_fn not in TINKER_MASKED_BUILTINS)
        )

    @property
    def use_fewshot(self) -> bool:
        """Few-shot prompts for real models or a --fewshot-file; the built-in model has its own."""
        if self.fewshot is not None:
            return self.fewshot
        return self.fewshot_file is not None or self.base_model not in BUILTIN_MODEL_NAMES


def check_combinations(config: TrainConfig) -> None:
    """The combinations across groups that cannot do what they say, refused naming both flags
    (each group checks its own fields: --recipe distill needs --teacher, --env-arg an OpenEnv
    --env, ...)."""
    if config.group_size < 2 and config.recipe != "distill":
        raise ConfigError(
            f"--group-size must be >= 2 (a group of one has no baseline), got {config.group_size}"
        )
    if config.env is not None and config.reward:
        raise ConfigError(
            f"--reward {config.reward[0]} with --env {config.env}: an episode's return is the "
            "environment's reward, so --reward would be ignored; drop --reward, or score the "
            "answer inside the environment's step"
        )
    if config.recipe == "distill" and config.env is not None and config.teacher_system_prompt:
        raise ConfigError(
            "--teacher-system-prompt with --env: the teacher scores each episode's own stream "
            "(the environment's prompt), so a teacher system message has nowhere to go; drop "
            "--teacher-system-prompt, or put the privileged context in the environment"
        )
    if config.recipe == "distill" and config.dynamic_sampling:
        raise ConfigError(
            "--dynamic-sampling refills degenerate groups, and under grpo distill no group is "
            "degenerate (the teacher scores every one); drop --dynamic-sampling"
        )
    if config.num_substeps > config.batch_size:
        raise ConfigError(
            f"--num-substeps must be in [1, --batch-size={config.batch_size}], "
            f"got {config.num_substeps}"
        )


FIELDS: Mapping[str, Field] = attrs.fields_dict(TrainConfig)
FIELD_NAMES: frozenset[str] = frozenset(FIELDS)


def check_keys(overrides: Mapping[str, object], *, where: str) -> None:
    """Reject keys that are not `grpo train` flags, naming the key and the fix."""
    for key in overrides:
        if key not in FIELD_NAMES:
            raise ConfigError(
                f"{where}: unknown train flag {key!r} ({flag_name(key)}); "
                "see `grpo train --help` for the flags"
            )


def check_value(name: str, value: object) -> Any:
    """`value` converted and checked as field `name` alone (type and range; ConfigError if not)."""
    field = FIELDS[name]
    if field.converter is not None:
        value = field.converter(value)
    if field.validator is not None:
        field.validator(None, field, value)
    return value


def config_from_dict(values: Mapping[str, object], *, where: str | None = None) -> TrainConfig:
    """A TrainConfig from flag values (underscore keys); errors prefixed with `where` if given."""
    check_keys(values, where=where or "configuration")
    try:
        return TrainConfig(**values)
    except ConfigError as error:
        if where is None:
            raise
        raise ConfigError(f"{where}: {error}") from None


def check_user_inputs(config: TrainConfig, *, where: str | None = None) -> None:
    """Load what the config names outside itself: every --reward, then the --fewshot-file.

    The explicit step before a run (or a planned run) touches any service; ConfigError naming
    the flag and the fix, prefixed with `where` if given, as `config_from_dict` does.
    """
    try:
        _ = config.reward_fns
        _ = config.prompt_template
        if config.env is not None:
            _ = config.env_factory
    except ConfigError as error:
        if where is None:
            raise
        raise ConfigError(f"{where}: {error}") from None


def to_dict(config: TrainConfig) -> dict[str, object]:
    """The config as a JSON-ready dict (tuples become lists)."""
    return attrs.asdict(
        config,
        value_serializer=lambda _inst, _field, value: (
            list(value) if isinstance(value, tuple) else value
        ),
    )


def default_run_name(config: TrainConfig) -> str:
    """`<loss>-seed<k>-<local time>` (a distillation: `distill-seed<k>-<local time>`, as a
    data recipe's `sft-...`): unique per launch, readable in a listing."""
    what = "distill" if config.recipe == "distill" else config.loss_fn
    return f"{what}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resolve_run(config: TrainConfig) -> TrainConfig:
    """The config with its derived run name and directory filled in, once, right after parsing.

    run_name: --run-name, else the run directory's name, else `default_run_name`;
    run_dir: --run-dir, else runs/<run name>. `steps` under --all-data needs the dataset's
    size, so the loop resolves it after loading the data.
    """
    directory_name = Path(config.run_dir).name if config.run_dir else ""
    if directory_name in ("", ".", ".."):
        directory_name = ""
    run_name = config.run_name or directory_name or default_run_name(config)
    run_dir = config.run_dir or str(Path("runs") / run_name)
    return attrs.evolve(config, run_name=run_name, run_dir=run_dir)
