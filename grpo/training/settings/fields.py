"""The field-check machinery of `grpo.training.settings.config.TrainConfig`: the flag factory and
validators.

- `flag(default, help, *checks)`: an attrs field carrying its CLI help and its checks;
  `with_checks` (the class's field transformer) adds every field's strict type check first
  (`StrictType`: ints accepted for floats, every float finite) and its TOML/JSON converter;
- validators, small frozen callables whose repr says what they check: `OneOf`, `AtLeast`,
  `AtMost` and `Above` (each a one-sided `Bound`), `InRange`, `Interval`, `NOT_EMPTY`,
  `PLAIN_NAME`, `GOLD_RULE`;
- `Registry`: the names of a registry of `grpo.core` (`LOSS_NAMES`, `REDUCTION_NAMES`,
  `ADVANTAGE_NAMES`, `KL_ESTIMATOR_NAMES`, `MISMATCH_CORRECTION_NAMES`), imported when a value
  is checked, not at import: they load torch, and `grpo --help` stays light.

Every check raises `ConfigError` naming the flag, the value and the fix.
"""

import functools
import importlib
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import attrs

Field: TypeAlias = "attrs.Attribute[Any]"
"""A field of a configuration record (its value's type varies from field to field)."""
Check = Callable[[object, Field, Any], None]


class ConfigError(ValueError):
    """A flag or input that cannot work; raised before any sampling or training."""


def flag_name(name: str) -> str:
    """The command-line flag of field `name`: `max_tokens` -> `--max-tokens`."""
    return "--" + name.replace("_", "-")


def flag(default: Any, help: str, *checks: Check, metavar: str | None = None) -> Any:
    """An attrs field carrying its CLI help (metadata["help"]) and its checks, run in order;
    `metavar`: how `--help` writes an entry of a repeatable flag (default KEY=VALUE)."""
    return attrs.field(
        default=default,
        validator=attrs.validators.and_(*checks) if checks else None,
        metadata={"help": help} if metavar is None else {"help": help, "metavar": metavar},
    )


HELP_GROUPS = (
    "run",
    "data and task",
    "sampling",
    "loss",
    "update",
    "KL and mismatch",
    "environments and tools",
    "judge",
    "teacher",
    "evaluation and checkpoints",
    "service",
    "prices",
)
"""The argument groups of `grpo train --help` (and every recipe's command), in their order."""


# --- allowed values ----------------------------------------------------------------------


@attrs.frozen(repr=False)
class Registry:
    """The names of registry `module.name` (sorted if `sort`), imported when first read.

    `shown`: the names as `--help` lists them, written out so that help imports no torch
    (tests/training/test_flags.py checks they are the registry's).
    """

    module: str
    name: str
    shown: tuple[str, ...]
    sort: bool = False

    def names(self) -> list[str]:
        """The registry's names, in its own order or sorted."""
        names = list(getattr(importlib.import_module(self.module), self.name))
        return sorted(names) if self.sort else names

    def __repr__(self) -> str:
        name = f"{self.module}.{self.name}"
        return f"sorted({name})" if self.sort else name


ADVANTAGE_NAMES = Registry(
    "grpo.core.advantages", "ADVANTAGES", ("center", "standardize", "rloo", "batch_standardize")
)
LOSS_NAMES = Registry(
    "grpo.core.losses",
    "LOSSES",
    ("cispo", "cross_entropy", "dro", "gspo", "importance_sampling", "ppo"),
    sort=True,
)
REDUCTION_NAMES = Registry(
    "grpo.core.losses",
    "REDUCTIONS",
    ("sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
)
KL_ESTIMATOR_NAMES = Registry("grpo.core.losses", "KL_ESTIMATORS", ("k1", "k2", "k3"))
MISMATCH_CORRECTION_NAMES = Registry(
    "grpo.core.mismatch",
    "MISMATCH_CORRECTIONS",
    ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "recompute"),
)
REGISTRIES = (
    ADVANTAGE_NAMES,
    LOSS_NAMES,
    REDUCTION_NAMES,
    KL_ESTIMATOR_NAMES,
    MISMATCH_CORRECTION_NAMES,
)


@attrs.frozen(repr=False)
class OneOf:
    """Value must be one of `allowed` (a tuple, or a `Registry` read when checked); None
    passes too when `none_ok` (an optional choice: "not given")."""

    allowed: tuple[str, ...] | Registry
    none_ok: bool = False

    def __call__(self, _instance: object, attribute: Field, value: str | None) -> None:
        allowed = self.allowed.names() if isinstance(self.allowed, Registry) else self.allowed
        if value is None and self.none_ok:
            return
        if value not in allowed:
            raise ConfigError(
                f"{flag_name(attribute.name)} {value!r} is not one of {', '.join(allowed)}"
            )

    def __repr__(self) -> str:
        return f"OneOf({self.allowed!r})"

    @property
    def shown(self) -> tuple[str, ...]:
        """The allowed names as `--help` lists them (a registry's without importing it)."""
        return self.allowed.shown if isinstance(self.allowed, Registry) else self.allowed


# --- ranges ------------------------------------------------------------------------------


_RELATIONS: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    ">=": ("AtLeast", operator.ge),
    "<=": ("AtMost", operator.le),
    ">": ("Above", operator.gt),
}
"""Each relation of a one-sided bound: the name it is made by, and whether it holds."""


@attrs.frozen(repr=False)
class Bound:
    """Value `relation` `bound` (None passes): one side of a range, made as `AtLeast(low)`
    (>=), `AtMost(high)` (<=: a bound past which sums of it overflow) or `Above(low)` (>);
    `why` is appended to the bound in the message."""

    relation: str = attrs.field(validator=attrs.validators.in_(_RELATIONS))
    bound: float
    why: str = ""

    def __call__(self, _instance: object, attribute: Field, value: float | None) -> None:
        _, holds = _RELATIONS[self.relation]
        if value is not None and not holds(value, self.bound):
            raise ConfigError(
                f"{flag_name(attribute.name)} must be {self.relation} {self.bound:g}{self.why}, "
                f"got {value}"
            )

    def __repr__(self) -> str:
        maker, _ = _RELATIONS[self.relation]
        return f"{maker}({self.bound!r}{f', {self.why!r}' if self.why else ''})"


AtLeast = functools.partial(Bound, ">=")
AtMost = functools.partial(Bound, "<=")
Above = functools.partial(Bound, ">")


@attrs.frozen(repr=False)
class InRange:
    """Value in the integer range `values` (its bounds are stated inclusive)."""

    values: range

    def __call__(self, _instance: object, attribute: Field, value: int) -> None:
        if value not in self.values:
            raise ConfigError(
                f"{flag_name(attribute.name)} must be in "
                f"[{self.values.start}, {self.values.stop - 1}], got {value}"
            )

    def __repr__(self) -> str:
        return f"InRange({self.values!r})"


@attrs.frozen(repr=False)
class Interval:
    """Value in the real interval `text`: "[0, 1)" is 0 <= value < 1, "(0, 1]" 0 < value <= 1."""

    low: float
    high: float
    closed: str
    """Which ends belong to the interval: "left" or "right"."""

    def __call__(self, _instance: object, attribute: Field, value: float) -> None:
        inside = (
            self.low <= value < self.high
            if self.closed == "left"
            else self.low < value <= self.high
        )
        if not inside:
            raise ConfigError(f"{flag_name(attribute.name)} must be in {self.text}, got {value}")

    @property
    def text(self) -> str:
        """The interval as written in the message: "[0, 1)" or "(0, 1]"."""
        left, right = ("[", ")") if self.closed == "left" else ("(", "]")
        return f"{left}{self.low}, {self.high}{right}"

    def __repr__(self) -> str:
        return f"Interval({self.text})"


# --- text --------------------------------------------------------------------------------


@attrs.frozen
class NotEmpty:
    """A text value (None passes) must not be blank."""

    def __call__(self, _instance: object, attribute: Field, value: str | None) -> None:
        if value is not None and not value.strip():
            raise ConfigError(f"{flag_name(attribute.name)} must not be empty, got {value!r}")


@attrs.frozen
class PlainName:
    """A run name names a directory and a SwanLab run: one path component, no `..`."""

    def __call__(self, _instance: object, attribute: Field, value: str | None) -> None:
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


@attrs.frozen
class EnvVarName:
    """The name of an environment variable (None passes): letters, digits and '_', not a
    digit first. A value that is not one is most likely the secret itself, refused unechoed."""

    def __call__(self, _instance: object, attribute: Field, value: str | None) -> None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ConfigError(
                f"{flag_name(attribute.name)} takes the NAME of an environment variable "
                "(letters, digits, '_'), not a key; e.g. export JUDGE_KEY=... and pass "
                f"{flag_name(attribute.name)} JUDGE_KEY"
            )


@attrs.frozen
class GoldRule:
    """'####', 'whole' or 'regex:PATTERN' with a pattern that compiles."""

    def __call__(self, _instance: object, attribute: Field, value: str) -> None:
        if value in ("####", "whole"):
            return
        if not value.startswith("regex:"):
            raise ConfigError(
                f"{flag_name(attribute.name)} {value!r} is not '####', 'whole' or "
                "'regex:PATTERN', e.g. --gold-rule 'regex:answer is (\\d+)'"
            )
        try:
            re.compile(value.removeprefix("regex:"))
        except re.error as error:
            raise ConfigError(
                f"{flag_name(attribute.name)} {value!r}: bad regex ({error})"
            ) from None


@attrs.frozen
class TrackerList:
    """--log-to: one or more of TRACKER_NAMES, each once; `none` only alone."""

    def __call__(self, _instance: object, attribute: Field, value: tuple[str, ...]) -> None:
        from grpo.training.trackers.base import TRACKER_NAMES

        cli = flag_name(attribute.name)
        unknown = [name for name in value if name not in TRACKER_NAMES]
        if unknown:
            raise ConfigError(
                f"{cli} {unknown[0]!r} is not one of {', '.join(TRACKER_NAMES)} "
                f"(repeat the flag for several: {cli} wandb {cli} tensorboard)"
            )
        if not value:
            raise ConfigError(f"{cli} needs at least one tracker (or {cli} none)")
        if len(set(value)) != len(value):
            raise ConfigError(f"{cli} names a tracker twice: {', '.join(value)}")
        if "none" in value and len(value) > 1:
            raise ConfigError(
                f"{cli} none means no tracker, so it cannot go with {cli} "
                f"{next(name for name in value if name != 'none')}; drop one"
            )


NOT_EMPTY = NotEmpty()
TRACKER_LIST = TrackerList()
PLAIN_NAME = PlainName()
GOLD_RULE = GoldRule()
ENV_VAR_NAME = EnvVarName()
MAX_PRICE = 1e9  # per million tokens: costs of any run stay finite


def price_flag(help: str) -> Any:
    """A --price-* flag: a price per million tokens, None when not given (then the price
    file's), else in [0, MAX_PRICE]."""
    return flag(None, help, AtLeast(0, " (a price per million tokens)"), AtMost(MAX_PRICE))


# --- types -------------------------------------------------------------------------------


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


def field_kind(field: Field) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed): `int | None` -> (int, True)."""
    annotation = field.type
    args = getattr(annotation, "__args__", ())
    if type(None) in args and getattr(annotation, "__origin__", None) is not tuple:
        return next(arg for arg in args if arg is not type(None)), True
    return annotation, False


def _example(name: str, default: object) -> str:
    return f" (e.g. {flag_name(name)} {default}, or {name} = {default!r} in TOML)"


@attrs.frozen(repr=False)
class StrictType:
    """Value of type `kind` exactly (None if `optional`; ints accepted for floats; floats finite).

    A `kind` other than bool, int, float and str is a tuple of KEY=VALUE strings.
    """

    kind: Any
    optional: bool

    def __call__(self, _instance: object, attribute: Field, value: object) -> None:
        if value is None and self.optional:
            return
        kind, name, cli = self.kind, attribute.name, flag_name(attribute.name)
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{cli} must be true or false, got {value!r}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    f"{cli} must be an integer, got {value!r}" + _example(name, attribute.default)
                )
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, float):
                raise ConfigError(
                    f"{cli} must be a number, got {value!r}" + _example(name, attribute.default)
                )
            if not math.isfinite(value):
                raise ConfigError(f"{cli} must be a finite number, got {value!r}")
        elif kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{cli} must be a string, got {value!r}")
        elif not (isinstance(value, tuple) and all(isinstance(item, str) for item in value)):
            raise ConfigError(
                f"{cli} must be a list of KEY=VALUE strings (or a TOML table), got {value!r}"
            )

    def __repr__(self) -> str:
        kind = self.kind.__name__ if isinstance(self.kind, type) else repr(self.kind)
        return f"StrictType({kind}{' | None' if self.optional else ''})"


def _convert(attribute: Field) -> Callable[[object], object] | None:
    """TOML/JSON values to the field's type: ints to floats, lists and tables to tuples."""
    kind, _ = field_kind(attribute)
    if kind is float:
        return _int_to_float
    if getattr(kind, "__origin__", None) is tuple:
        return _key_value_entries
    return None


def _int_to_float(value: object) -> object:
    """An int as a float (TOML `lr = 1`); anything else, or an int too large, as given."""
    if type(value) is int and abs(value) < 2**1023:
        return float(value)
    return value


def _key_value_entries(value: object) -> object:
    """A list stays a list of entries as a tuple; a table {k = v} becomes ("k=v", ...)."""
    if isinstance(value, Mapping):
        return tuple(f"{key}={item}" for key, item in value.items())
    if isinstance(value, list):
        return tuple(value)
    return value


def with_checks(_cls: type, fields: list[Field]) -> list[Field]:
    """Give every field of the class itself its strict type check (first) and its converter
    (a field transformer); inherited fields were given theirs by the class defining them."""
    checked = []
    for field in fields:
        if field.inherited:
            checked.append(field)
            continue
        own = [field.validator] if field.validator is not None else []
        checked.append(
            field.evolve(
                validator=attrs.validators.and_(StrictType(*field_kind(field)), *own),
                converter=_convert(field),
            )
        )
    return checked


FieldTransformer = Callable[[type, list[Field]], list[Field]]


def grouped(title: str) -> FieldTransformer:
    """The field transformer of a group of flags: `with_checks`, and each of the class's own
    fields shown under `title` (one of HELP_GROUPS) in `--help`."""
    if title not in HELP_GROUPS:
        raise ValueError(f"help group {title!r} is not one of {', '.join(HELP_GROUPS)}")

    def transform(cls: type, fields: list[Field]) -> list[Field]:
        titled = [
            field
            if field.inherited or "group" in field.metadata
            else field.evolve(metadata={**field.metadata, "group": title})
            for field in fields
        ]
        return with_checks(cls, titled)

    return transform


def help_group(field: Field) -> str:
    """The `--help` group of `field` ("run" for a field no group class defines)."""
    return str(field.metadata.get("group", "run"))
