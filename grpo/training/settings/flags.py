"""`TrainConfig` <-> command lines: argparse arguments, argv lists, TOML files and overrides.

The one module that turns `grpo.training.settings.config.TrainConfig` fields into `--flags` (for
`grpo train`, `grpo compare`, `grpo sweep`) and back into argv lists (the subprocesses `compare` and
`sweep` launch), reads TOML flag files and merges the sources of a run's configuration:
defaults < a resumed run's config.json < `--config FILE.toml` < flags on the command line.
Every value is checked by the field's own validators in `grpo.training.settings.config`.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from grpo.training.run import run_files
from grpo.training.settings.config import (
    FIELDS,
    ConfigError,
    TrainConfig,
    check_keys,
    check_value,
    config_from_dict,
    flag_name,
)
from grpo.training.settings.fields import HELP_GROUPS, Field, OneOf, field_kind, help_group


def add_train_arguments(
    parser: argparse._ActionsContainer,
    *,
    exclude: Iterable[str] = (),
    fields: Mapping[str, Field] = FIELDS,
) -> dict[str, argparse._ActionsContainer]:
    """One `--flag` per field of `fields` (TrainConfig's) but `exclude`; unset flags stay out of
    the namespace. On a parser, each flag goes in its field's help group (HELP_GROUPS, in that
    order; groups without flags are not shown); on an argument group, all go in that group.
    Returns the containers by group title, so a command can add its own flags to one."""
    excluded = set(exclude)
    if isinstance(parser, argparse.ArgumentParser):
        groups = {title: parser.add_argument_group(title) for title in HELP_GROUPS}
    else:
        groups = dict.fromkeys(HELP_GROUPS, parser)
    for name, field in fields.items():
        if name in excluded:
            continue
        kind, _ = field_kind(field)
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": help_text(field),
        }
        choices = field_choices(field)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif getattr(kind, "__origin__", None) is tuple:
            kwargs.update(action="append", metavar=field.metadata.get("metavar", "KEY=VALUE"))
        else:
            kwargs["type"] = kind
            if choices:
                kwargs["metavar"] = "{" + ",".join(choices) + "}"
        groups[help_group(field)].add_argument(flag_name(name), **kwargs)
    return groups


def field_choices(field: Field) -> tuple[str, ...]:
    """The values a `OneOf` field allows, as `--help` lists them (() for any other field)."""
    validator = field.validator
    checks = getattr(validator, "_validators", (validator,))
    for check in checks:
        if isinstance(check, OneOf):
            return check.shown
    return ()


def help_text(field: Field) -> str:
    """A field's help with its default said once: the help's own words when they state it
    ("(default: ...)"), else "(default: VALUE)" appended."""
    text = str(field.metadata["help"])
    if "default" not in text:
        default = field.default
        shown = (
            ", ".join(map(repr, default))
            if isinstance(default, tuple) and default
            else "none"
            if default is None or default == ()
            else repr(default)
        )
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def explicit_flags(
    args: argparse.Namespace, *, exclude: Iterable[str] = (), fields: Mapping[str, Field] = FIELDS
) -> dict[str, Any]:
    """The flags of `fields` set on the command line (those `add_train_arguments` added)."""
    excluded = set(exclude)
    return {
        name: getattr(args, name) for name in fields if name not in excluded and hasattr(args, name)
    }


def train_argv(overrides: Mapping[str, object]) -> list[str]:
    """The `grpo train` arguments that set each field of `overrides` (others keep their defaults).

    Booleans are switches (`--custom-loss`; False is the absent switch, or `--no-fewshot` for
    a field whose default is not False); sequences repeat the flag; None leaves a None default.
    A value starting with '-' is written `--flag=value` so argparse cannot take it for a flag.
    """
    argv: list[str] = []
    for name, value in overrides.items():
        if name not in FIELDS:
            raise ConfigError(f"unknown train flag {name!r} ({flag_name(name)})")
        flag, default = flag_name(name), FIELDS[name].default
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif default is not False:
                argv.append("--no-" + flag[2:])
        elif value is None:
            if default is not None:
                raise ConfigError(
                    f"{name} = None: {flag} needs a value (its default is {default!r})"
                )
        else:
            for item in value if isinstance(value, (list, tuple)) else [value]:
                text = str(item)
                argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return argv


def _line_of(text: str, key: str) -> int | None:
    """The 1-based line where TOML key `key` is assigned (first match), if it can be found."""
    match = re.search(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=", text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else None


def checked_overrides(
    raw: Mapping[str, object], *, where: str, text: str | None = None
) -> dict[str, Any]:
    """Flag values with underscore keys, each converted and checked by its field (ConfigError).

    `text`: the TOML source, so an error names the line of the offending key.
    """
    overrides: dict[str, Any] = {}
    for raw_key, value in raw.items():
        key = raw_key.replace("-", "_")
        line = _line_of(text, raw_key) if text is not None else None
        at = f"{where} line {line}" if line else where
        check_keys({key: value}, where=at)
        try:
            overrides[key] = check_value(key, value)
        except ConfigError as error:
            raise ConfigError(f"{at}: {error}") from None
    return overrides


def read_toml(path: str | Path, *, what: str) -> tuple[dict[str, Any], str]:
    """The table in TOML file `path` and its text; ConfigError naming the file and the line."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {file} not found; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {file} is a directory, not a TOML file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{what} {file} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as error:
        # Python 3.11's message ends "(at line L, column C)".
        raise ConfigError(f"{file}: not valid TOML: {error}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file of flag values (keys as in `grpo train --help`, - or _), each checked."""
    raw, text = read_toml(path, what="--config file")
    return checked_overrides(raw, where=str(path), text=text)


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """Merge defaults (or the resumed run's config), the `--config` TOML file and explicit flags."""
    explicit = checked_overrides(explicit_flags(args), where="command line")
    base: dict[str, Any] = {}
    resume = args.resume is not None
    if resume:
        resume_dir = Path(args.resume)
        saved = run_files.read_config(resume_dir)
        base = checked_overrides(saved, where=str(resume_dir / run_files.CONFIG_FILE))
        explicit["run_dir"] = str(resume_dir)
    if args.config_file:
        base.update(load_toml(args.config_file))
    base.update(explicit)
    return config_from_dict(base), resume
