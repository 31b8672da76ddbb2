"""The typed configuration of a GRPO run: one field per `grpo train` flag, defined and checked here.

The CLI, TOML config files, a run's saved `config.json`, `grpo compare` and `grpo sweep` all
build this one class, so a flag's name, type, default, help and allowed values live here
once. Field `foo_bar` is flag `--foo-bar`. Building a `TrainConfig` checks everything that
needs no data and no model (types, ranges, finiteness, names from the registries of
`grpo.core`, the loss and its config) and raises `ConfigError` naming the flag, the value and
the fix, so a bad flag never fails after a step ran.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo.backends.names import TINY_MODEL_NAME
from grpo.tasks.prompts import QUESTION_SUFFIX

if TYPE_CHECKING:
    from grpo.core.loss_spec import LossSpec
    from grpo.core.mismatch import MismatchCorrection
    from grpo.rewards import RewardFn
    from grpo.tasks.prompts import PromptTemplate

BACKENDS = ("local", "pytrio")
SWANLAB_MODES = ("online", "offline", "disabled")
SAMPLER_DTYPES = ("float32", "bfloat16")
# PyTRIO's `create_lora_training_client` accepts ranks 4..64 (pytrio/client/service.py);
# the local backend enforces the same range.
LORA_RANKS = range(4, 65)
# numpy's SeedSequence needs seeds >= 0 and the samplers take 31-bit seeds.
SEEDS = range(0, 2**31)


class ConfigError(ValueError):
    """A flag or input that cannot work; raised before any sampling or training."""


def flag_name(name: str) -> str:
    """The command-line flag of field `name`: `max_tokens` -> `--max-tokens`."""
    return "--" + name.replace("_", "-")


# --- field checks ------------------------------------------------------------------------

Check = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _flag(
    default: Any, help: str, *checks: Check, choices: Callable[[], Iterable[str]] | None = None
) -> Any:
    """An attrs field carrying its CLI help, its range checks and its allowed values."""
    validators = list(checks)
    if choices is not None:
        validators.append(_one_of(choices))
    return attrs.field(
        default=default,
        validator=attrs.validators.and_(*validators) if validators else None,
        metadata={"help": help},
    )


def _one_of(names: Callable[[], Iterable[str]]) -> Check:
    """Value must be one of `names()` (read when checked: torch-backed registries load lazily)."""

    def check(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        allowed = list(names())
        if value not in allowed:
            raise ConfigError(
                f"{flag_name(attribute.name)} {value!r} is not one of {', '.join(allowed)}"
            )

    return check


def _at_least(low: float, why: str = "") -> Check:
    def check(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value is not None and value < low:
            raise ConfigError(f"{flag_name(attribute.name)} must be >= {low}{why}, got {value}")

    return check


def _positive(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if not value > 0:
        raise ConfigError(f"{flag_name(attribute.name)} must be > 0, got {value}")


def _in_range(values: range) -> Check:
    def check(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value not in values:
            raise ConfigError(
                f"{flag_name(attribute.name)} must be in [{values.start}, {values.stop - 1}], "
                f"got {value}"
            )

    return check


def _unit_interval(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"{flag_name(attribute.name)} must be in [0, 1), got {value}")


def _top_p(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{flag_name(attribute.name)} must be in (0, 1], got {value}")


def _price(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and value < 0:
        raise ConfigError(
            f"{flag_name(attribute.name)} must be >= 0 (a price per million tokens), got {value}"
        )


def _not_empty(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and not value.strip():
        raise ConfigError(f"{flag_name(attribute.name)} must not be empty, got {value!r}")


def _plain_name(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    """A run name names a directory and a SwanLab run: one path component, no `..`."""
    if value is None:
        return
    bad = (
        not value.strip()
        or "/" in value
        or "\\" in value
        or ".." in value
        or value == "."
        or any(ord(char) < 32 for char in value)
    )
    if bad:
        raise ConfigError(
            f"{flag_name(attribute.name)} {value!r} must be a plain name: not empty, no '/', "
            "'\\', '..' or control characters (choose the directory with --run-dir), "
            "e.g. --run-name ppo-seed0"
        )


def _gold_rule(_instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    """'####', 'whole' or 'regex:PATTERN' with a pattern that compiles."""
    if value in ("####", "whole"):
        return
    if not value.startswith("regex:"):
        raise ConfigError(
            f"{flag_name(attribute.name)} {value!r} is not '####', 'whole' or 'regex:PATTERN', "
            "e.g. --gold-rule 'regex:answer is (\\d+)'"
        )
    import re

    try:
        re.compile(value.removeprefix("regex:"))
    except re.error as error:
        raise ConfigError(f"{flag_name(attribute.name)} {value!r}: bad regex ({error})") from None


def field_kind(field: "attrs.Attribute[Any]") -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed): `int | None` -> (int, True)."""
    annotation = field.type
    args = getattr(annotation, "__args__", ())
    if type(None) in args and getattr(annotation, "__origin__", None) is not tuple:
        return next(arg for arg in args if arg is not type(None)), True
    return annotation, False


def _example(name: str, default: Any) -> str:
    return f" (e.g. {flag_name(name)} {default}, or {name} = {default!r} in TOML)"


def _type_check(attribute: "attrs.Attribute[Any]") -> Check:
    """Strict type of a field (ints accepted for floats; every float finite)."""
    kind, optional = field_kind(attribute)
    name, default = attribute.name, attribute.default

    def check(_instance: Any, _attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value is None and optional:
            return
        flag = flag_name(name)
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be true or false, got {value!r}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    f"{flag} must be an integer, got {value!r}" + _example(name, default)
                )
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, float):
                raise ConfigError(
                    f"{flag} must be a number, got {value!r}" + _example(name, default)
                )
            if not math.isfinite(value):
                raise ConfigError(f"{flag} must be a finite number, got {value!r}")
        elif kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{flag} must be a string, got {value!r}")
        elif not (isinstance(value, tuple) and all(isinstance(item, str) for item in value)):
            raise ConfigError(
                f"{flag} must be a list of KEY=VALUE strings (or a TOML table), got {value!r}"
            )

    return check


def _convert(attribute: "attrs.Attribute[Any]") -> Callable[[Any], Any] | None:
    """TOML/JSON values to the field's type: ints to floats, lists and tables to tuples."""
    kind, _ = field_kind(attribute)
    if kind is float:
        return _int_to_float
    if getattr(kind, "__origin__", None) is tuple:
        return _key_value_entries
    return None


def _int_to_float(value: Any) -> Any:
    """An int as a float (TOML `lr = 1`); anything else, or an int too large, as given."""
    if type(value) is int and abs(value) < 2**1023:
        return float(value)
    return value


def _key_value_entries(value: Any) -> Any:
    """A list stays a list of entries as a tuple; a table {k = v} becomes ("k=v", ...)."""
    if isinstance(value, Mapping):
        return tuple(f"{key}={item}" for key, item in value.items())
    if isinstance(value, list):
        return tuple(value)
    return value


def _with_checks(_cls: type, fields: list["attrs.Attribute[Any]"]) -> list["attrs.Attribute[Any]"]:
    """Give every field its type check (first) and its converter."""
    checked = []
    for field in fields:
        own = [field.validator] if field.validator is not None else []
        checked.append(
            field.evolve(
                validator=attrs.validators.and_(_type_check(field), *own),
                converter=_convert(field),
            )
        )
    return checked


# The registries of grpo.core load torch: they are read when a config is checked, not at import,
# so `grpo --help` stays light.
def _advantage_names() -> Iterable[str]:
    from grpo.core.advantages import ADVANTAGES

    return ADVANTAGES


def _loss_names() -> Iterable[str]:
    from grpo.core.losses import LOSSES

    return sorted(LOSSES)


def _reductions() -> Iterable[str]:
    from grpo.core.losses import REDUCTIONS

    return REDUCTIONS


def _mismatch_corrections() -> Iterable[str]:
    from grpo.core.mismatch import MISMATCH_CORRECTIONS

    return MISMATCH_CORRECTIONS


def _kl_estimators() -> Iterable[str]:
    from grpo.core.losses import KL_ESTIMATORS

    return KL_ESTIMATORS


# --- the configuration -------------------------------------------------------------------


@attrs.frozen(field_transformer=_with_checks)
class TrainConfig:
    """Every knob of `grpo train`; defaults give the offline default run on the local backend."""

    # Model and backend
    backend: str = _flag(
        "local",
        "where training runs: the embedded local model or the PyTRIO service",
        choices=lambda: BACKENDS,
    )
    base_model: str = _flag(
        TINY_MODEL_NAME,
        "base model name (PyTRIO catalog id, the built-in tiny model, or a local HF directory)",
        _not_empty,
    )
    lora_rank: int = _flag(
        32, f"LoRA rank ({LORA_RANKS.start}..{LORA_RANKS.stop - 1})", _in_range(LORA_RANKS)
    )
    # Data
    dataset: str = _flag(
        "arithmetic",
        "problems: a built-in name ('arithmetic', 'wordproblems', 'gsm8k'), a local "
        "JSONL/Parquet/CSV file or "
        "directory, or a hub dataset OWNER/NAME (with --dataset-config, --train-split)",
        _not_empty,
    )
    dataset_config: str | None = _flag(
        None, "configuration of a hub --dataset (e.g. 'main' for openai/gsm8k)", _not_empty
    )
    train_split: str = _flag("train", "split of a hub --dataset to train on", _not_empty)
    test_split: str = _flag("test", "split of a hub --dataset to evaluate on", _not_empty)
    prompt_column: str = _flag("question", "dataset column holding the question", _not_empty)
    answer_column: str = _flag("answer", "dataset column holding the answer", _not_empty)
    gold_rule: str = _flag(
        "####",
        "how the gold answer comes from the answer column: '####' (the text after the last "
        "####), 'whole' (the whole field) or 'regex:PATTERN' (group 1 of the last match)",
        _gold_rule,
    )
    system_prompt: str | None = _flag(None, "system message put before every prompt (default none)")
    question_suffix: str = _flag(
        QUESTION_SUFFIX, "text appended to every question (default: the article's instruction)"
    )
    fewshot_file: str | None = _flag(
        None,
        "JSON file of few-shot messages [{role, content}, ...] replacing the built-in example "
        "(turns --fewshot on unless --no-fewshot)",
        _not_empty,
    )
    all_data: bool = _flag(
        False, "iterate over the whole train split instead of --steps x --batch-size problems"
    )
    difficulty: int = _flag(
        1,
        "difficulty of the built-in arithmetic problems (operands 0..2*10^difficulty)",
        _at_least(1),
    )
    fewshot: bool | None = _flag(
        None,
        "prepend the few-shot example to prompts "
        "(default: on for real models, off for the tiny one)",
    )
    # Rollouts
    steps: int = _flag(80, "number of training steps (batches)", _at_least(1))
    batch_size: int = _flag(8, "prompts per step", _at_least(1))
    group_size: int = _flag(
        8, "completions sampled per prompt", _at_least(2, " (a group of one has no baseline)")
    )
    max_tokens: int = _flag(24, "maximum generated tokens per completion", _at_least(1))
    temperature: float = _flag(1.0, "sampling temperature", _at_least(0))
    top_p: float = _flag(1.0, "nucleus sampling threshold", _top_p)
    concurrency: int = _flag(32, "sampling requests in flight at once", _at_least(1))
    max_steps_off_policy: int = _flag(
        0, "how many steps stale a rollout may be (0 = strictly on-policy)", _at_least(0)
    )
    dynamic_sampling: bool = _flag(
        False,
        "DAPO dynamic sampling: sample further prompts until --batch-size groups are "
        "non-degenerate (or --max-sampling-rounds)",
    )
    max_sampling_rounds: int = _flag(
        3, "most sampling rounds of a step under --dynamic-sampling (1 = no extra)", _at_least(1)
    )
    # Rewards
    reward: tuple[str, ...] = _flag(
        (),
        "reward MODULE:FUNCTION[=WEIGHT] or FILE.py:FUNCTION[=WEIGHT] (repeatable; "
        "default grpo.rewards:boxed_match)",
    )
    reward_errors: str = _flag(
        "stop",
        "a reward that raises or returns a non-finite/non-number: stop the run (with a "
        "checkpoint) or score it 0 and count it in reward/errors",
        choices=lambda: ("stop", "zero"),
    )
    reward_workers: int = _flag(
        0, "threads calling the rewards (0 = serial; results are identical)", _at_least(0)
    )
    overlong_buffer: int | None = _flag(
        None,
        "L of DAPO's overlong penalty (grpo.rewards:overlong_penalty): linear over the last L "
        "tokens before --max-tokens (default: --max-tokens // 4)",
        _at_least(1),
    )
    mask_truncated: bool = _flag(
        False, "completions stopped by --max-tokens train no tokens (DAPO overlong filtering)"
    )
    # Advantages and loss
    advantage: str = _flag("center", "group advantage estimator", choices=_advantage_names)
    loss_fn: str = _flag(
        "importance_sampling",
        "policy loss kernel (a name in grpo.core.losses.LOSSES; `grpo plot-losses` draws them)",
        choices=_loss_names,
    )
    loss_config: tuple[str, ...] = _flag(
        (), "loss_fn_config entry KEY=VALUE (repeatable), validated against the kernel's keys"
    )
    custom_loss: bool = _flag(
        False, "run the loss through forward_backward_custom with the core kernel"
    )
    reduction: str = _flag(
        "sum",
        "how token losses aggregate (a name in grpo.core.losses.REDUCTIONS: sum, token_mean, ...)",
        choices=_reductions,
    )
    cispo_clip_low_threshold: float = _flag(0.0, "CISPO lower ratio bound (the article's flag)")
    cispo_clip_high_threshold: float = _flag(4.0, "CISPO upper ratio bound (the article's flag)")
    mismatch_correction: str = _flag(
        "none",
        "sampler-trainer mismatch correction: token_truncate (truncated IS), token_mask "
        "(masked IS), sequence_truncate, sequence_mask (docs/FORMULAS.md); costs one forward",
        choices=_mismatch_corrections,
    )
    mismatch_cap: float = _flag(2.0, "truncated-IS cap C on the mismatch ratio (>= 1)")
    mismatch_mask_low: float = _flag(0.5, "masked IS: lowest mismatch ratio kept (<= 1)")
    mismatch_mask_high: float = _flag(2.0, "masked IS: highest mismatch ratio kept (>= 1)")
    sampler_dtype: str = _flag(
        "float32",
        "local backend: precision the sampler runs in (bfloat16 reproduces a real service's "
        "sampler-trainer mismatch; training stays float32)",
        choices=lambda: SAMPLER_DTYPES,
    )
    kl_coef: float = _flag(
        0.0, "KL-to-base-model penalty folded into token advantages (0 = off)", _at_least(0)
    )
    kl_estimator: str = _flag(
        "k1", "KL estimator for the penalty (k1, k2 or k3)", choices=_kl_estimators
    )
    num_substeps: int = _flag(
        2, "minibatches per step, one optimizer step each (1..--batch-size)", _at_least(1)
    )
    epochs: int = _flag(1, "passes over each batch (PPO-style reuse)", _at_least(1))
    # Optimizer
    learning_rate: float = _flag(2e-4, "Adam learning rate", _positive)
    beta1: float = _flag(0.9, "Adam beta1", _unit_interval)
    beta2: float = _flag(0.95, "Adam beta2", _unit_interval)
    eps: float = _flag(1e-8, "Adam epsilon", _positive)
    weight_decay: float = _flag(0.0, "AdamW weight decay", _at_least(0))
    grad_clip_norm: float = _flag(1.0, "global gradient-norm clip (0 = off)", _at_least(0))
    # Evaluation, checkpoints, logging
    seed: int = _flag(
        0, f"seed for data order, sampling and LoRA init (0..{SEEDS.stop - 1})", _in_range(SEEDS)
    )
    eval_every: int = _flag(
        40, "evaluate on the test split before training and every N steps (0 = never)", _at_least(0)
    )
    eval_limit: int = _flag(300, "test problems per evaluation", _at_least(1))
    save_every: int = _flag(
        20, "save a resumable checkpoint every N steps (0 = only at the end)", _at_least(0)
    )
    run_dir: str | None = _flag(None, "run directory (default: runs/<run name>)", _not_empty)
    run_name: str | None = _flag(
        None,
        "run name (default: the run directory's name, else derived from loss, seed and time)",
        _plain_name,
    )
    swanlab_mode: str = _flag("disabled", "SwanLab logging mode", choices=lambda: SWANLAB_MODES)
    swanlab_project: str = _flag("grpo", "SwanLab project name", _not_empty)
    connect_timeout: float = _flag(
        30.0, "seconds to wait for the PyTRIO service to answer before giving up", _positive
    )
    max_retries: int = _flag(
        3,
        "retries of a failed sampling/training call before the run stops with a checkpoint",
        _at_least(0),
    )
    log_rollouts: int = _flag(
        4, "groups per step written to rollouts.jsonl (0 = none; see `grpo show`)", _at_least(0)
    )
    # Prices (none built in: a cost is shown only for prices the user gives)
    price_file: str | None = _flag(
        None, "TOML file of prices per million tokens, per model (see README, Cost)", _not_empty
    )
    price_prompt: float | None = _flag(
        None,
        "price per million prompt tokens sent to the sampler (overrides the file)",
        _price,
    )
    price_completion: float | None = _flag(
        None, "price per million sampled completion tokens (overrides the file)", _price
    )
    price_train: float | None = _flag(
        None, "price per million trained tokens (positions x passes; overrides the file)", _price
    )
    price_forward: float | None = _flag(
        None, "price per million forward-only tokens (default: the train price)", _price
    )
    price_currency: str | None = _flag(
        None, "currency of the prices (overrides the file's; e.g. CNY)", _not_empty
    )

    def __attrs_post_init__(self) -> None:
        if self.num_substeps > self.batch_size:
            raise ConfigError(
                f"--num-substeps must be in [1, --batch-size={self.batch_size}], "
                f"got {self.num_substeps}"
            )
        _ = self.loss_spec  # builds (and checks) the loss once, at construction
        _ = self.reward_fns  # imports and checks every --reward once, at construction
        _ = self.prompt_template  # reads and checks --fewshot-file
        _ = self.mismatch  # checks the correction against the loss
        if self.sampler_dtype != "float32" and self.backend != "local":
            raise ConfigError(
                f"--sampler-dtype {self.sampler_dtype} needs --backend local (a service's "
                "sampler precision is the service's); drop the flag or use --backend local"
            )

    @cached_property
    def reward_fns(self) -> tuple["RewardFn", ...]:
        """The loaded --reward callables (grpo.rewards:boxed_match when none is given)."""
        from grpo.rewards import load_rewards

        try:
            return load_rewards(self.reward)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @cached_property
    def prompt_template(self) -> "PromptTemplate":
        """--system-prompt, --question-suffix and the few-shot messages (--fewshot-file)."""
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
        from grpo.core.mismatch import MismatchCorrection

        try:
            correction = MismatchCorrection(
                self.mismatch_correction,
                cap=self.mismatch_cap,
                low=self.mismatch_mask_low,
                high=self.mismatch_mask_high,
            )
            correction.check_loss(self.loss_fn)
        except ValueError as error:
            raise ConfigError(
                f"--mismatch-correction / --mismatch-cap / --mismatch-mask-*: {error}"
            ) from None
        return correction

    @cached_property
    def loss_spec(self) -> "LossSpec":
        """The validated loss: --loss-fn, --loss-config (the CISPO flags folded in), --reduction.

        norm_length comes from `--loss-config norm_length=L`, else --max-tokens when the
        reduction is seq_mean_token_sum_norm (the constant L of docs/FORMULAS.md).
        """
        from grpo.core.loss_spec import LossSpec

        overrides = parse_loss_config(self.loss_config)
        norm_length = overrides.pop("norm_length", None)
        if self.loss_fn == "cispo":
            overrides = {
                "clip_low_threshold": self.cispo_clip_low_threshold,
                "clip_high_threshold": self.cispo_clip_high_threshold,
                **overrides,
            }
        if self.reduction == "seq_mean_token_sum_norm" and norm_length is None:
            norm_length = float(self.max_tokens)
        try:
            return LossSpec.build(
                self.loss_fn, overrides, reduction=self.reduction, norm_length=norm_length
            )
        except (ValueError, TypeError) as error:
            flags = "--loss-config" + (
                " / --cispo-clip-*-threshold" if self.loss_fn == "cispo" else ""
            )
            raise ConfigError(f"{flags}: {error}") from None

    @property
    def runs_custom_loss(self) -> bool:
        """Whether the loss runs client-side through forward_backward_custom.

        Asked for (--custom-loss), a kernel PyTRIO lacks, or a non-sum reduction on PyTRIO
        (its built-in losses only sum; the local backend reduces any way itself).
        """
        return (
            self.custom_loss
            or not self.loss_spec.kernel.service_builtin
            or (self.backend == "pytrio" and self.reduction != "sum")
        )

    @property
    def use_fewshot(self) -> bool:
        """Few-shot prompts for real models or a --fewshot-file; the built-in model has its own."""
        if self.fewshot is not None:
            return self.fewshot
        return self.fewshot_file is not None or self.base_model != TINY_MODEL_NAME


FIELDS: Mapping[str, "attrs.Attribute[Any]"] = attrs.fields_dict(TrainConfig)
FIELD_NAMES: frozenset[str] = frozenset(FIELDS)


def parse_loss_config(entries: Iterable[str]) -> dict[str, float | None]:
    """`KEY=VALUE` strings to a dict (numbers parsed; `none`/`off`/`null` mean None)."""
    parsed: dict[str, float | None] = {}
    for entry in entries:
        key, sep, raw = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--loss-config {entry!r} must look like KEY=VALUE, e.g. clip_high_threshold=1.28"
            )
        raw = raw.strip()
        if raw.lower() in ("none", "off", "null"):
            parsed[key.strip()] = None
            continue
        try:
            parsed[key.strip()] = float(raw)
        except ValueError:
            raise ConfigError(
                f"--loss-config {key.strip()}={raw!r}: value must be a number (or 'none')"
            ) from None
    return parsed


def check_keys(overrides: Mapping[str, Any], *, where: str) -> None:
    """Reject keys that are not `grpo train` flags, naming the key and the fix."""
    for key in overrides:
        if key not in FIELD_NAMES:
            raise ConfigError(
                f"{where}: unknown train flag {key!r} ({flag_name(key)}); "
                "see `grpo train --help` for the flags"
            )


def check_value(name: str, value: Any) -> Any:
    """`value` converted and checked as field `name` alone (type and range; ConfigError if not)."""
    field = FIELDS[name]
    if field.converter is not None:
        value = field.converter(value)
    if field.validator is not None:
        field.validator(None, field, value)
    return value


def config_from_dict(values: Mapping[str, Any], *, where: str | None = None) -> TrainConfig:
    """A TrainConfig from flag values (underscore keys); errors prefixed with `where` if given."""
    check_keys(values, where=where or "configuration")
    try:
        return TrainConfig(**values)
    except ConfigError as error:
        if where is None:
            raise
        raise ConfigError(f"{where}: {error}") from None


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as a JSON-ready dict (tuples become lists)."""
    return attrs.asdict(
        config,
        value_serializer=lambda _inst, _field, value: (
            list(value) if isinstance(value, tuple) else value
        ),
    )


def default_run_name(config: TrainConfig) -> str:
    """`<loss>-seed<k>-<local time>`: unique per launch, readable in a listing."""
    return f"{config.loss_fn}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


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
