"""What a command reads from disk, and the one rule for its outputs: never over an input.

Every command that writes (each recipe's `grpo train`/`sft`/... their `--run-dir`, `grpo eval`
`--out`, `grpo export`, `plot`, `show`, `checkpoints download`, `compare`/`sweep` their
`--out`, scripts/make_preference_pairs.py) calls `refuse_overlap` before any work: an output
that is, lies inside or holds a path the command reads is refused, `--force` or not. The
paths read are found by `read_paths` (a `local://` URI's directory, an existing path, the
FILE.py of a `FILE.py:FUNCTION` spec, and a run directory's weights), symlinks resolved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo.training.run import run_files
from grpo.training.settings.fields import ConfigError

LOCAL_SCHEME = "local://"

READ_FIELDS = (
    "base_model",
    "init_from",
    "dataset",
    "data",
    "eval_data",
    "fewshot_file",
    "reward",
    "judge_rubric",
    "env",
    "teacher",
    "ref",
    "price_file",
)
"""The config fields (of every recipe's config) that name something a run reads."""


@attrs.frozen
class ReadPath:
    """One local path a command reads: `what` names it for the user (flag and value)."""

    what: str
    path: Path
    """Resolved: absolute, symlinks followed."""


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def _weights(run_dir: Path, what: str) -> list[ReadPath]:
    """A run directory's weights on this machine: its final sampler weights and checkpoint."""
    found = []
    for kind, read in (("weights", run_files.eval_weights_path), ("checkpoint", _state_path)):
        try:
            uri = read(run_dir)
        except (run_files.RunDirError, ValueError, OSError):
            continue  # the command's own reading says what is wrong with the run
        if uri and (uri.startswith(LOCAL_SCHEME) or uri.startswith("/")):
            found.append(ReadPath(f"the {kind} of {what}", _resolved(_strip_scheme(uri))))
    return found


def _state_path(run_dir: Path) -> str:
    checkpoint = run_files.read_checkpoint(run_dir)
    return checkpoint.state_path if checkpoint is not None else ""


def _strip_scheme(uri: str) -> str:
    return uri[len(LOCAL_SCHEME) :] if uri.startswith(LOCAL_SCHEME) else uri


def read_paths(flag: str, value: Any) -> list[ReadPath]:
    """The existing local paths `value` of `flag` names (a list: each item's): a `local://`
    URI's directory, a path, the FILE.py of a `FILE.py:FUNCTION[=WEIGHT]` spec, and for a run
    directory its weights too; names (hub ids, built-in sources, modules) name none."""
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [read for item in value for read in read_paths(flag, item)]
    text = str(value)
    what = f"{flag} {text}"
    specs = [part.split("=", 1)[0] for part in text.split(":")]
    found: list[ReadPath] = []
    for candidate in [_strip_scheme(text), *(spec for spec in specs if spec.endswith(".py"))]:
        path = Path(candidate).expanduser()
        if not path.exists():
            continue
        found.append(ReadPath(what, _resolved(path)))
        if (path / run_files.CONFIG_FILE).is_file():
            found += _weights(path, what)
    return found


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def config_read_paths(config: Any, owner: str = "") -> list[ReadPath]:
    """Every local path a run's config reads (any recipe's config, the mapping
    of a run's config.json, or parsed flags); `owner` prefixes each flag ("the run R's ")."""
    return [
        read
        for name in READ_FIELDS
        for read in read_paths(owner + "--" + name.replace("_", "-"), _field(config, name))
    ]


def _relation(out: Path, read: Path) -> str | None:
    if out == read:
        return "is"
    if out.is_relative_to(read):
        return "lies inside"
    if read.is_relative_to(out):
        return "holds"
    return None


def refuse_overlap(out: str | Path, flag: str, reads: Iterable[ReadPath]) -> None:
    """ConfigError naming `flag`, the input and the fix when `out` is, lies inside or holds
    one of `reads` (symlinks resolved); no flag (`--force` included) lifts it."""
    resolved = _resolved(out)
    # A symlink on the way is shown resolved: the refusal must make sense to the user.
    linked = Path(out).expanduser().absolute() != resolved
    shown = f"{out} (= {resolved})" if linked else f"{out}"
    for read in reads:
        relation = _relation(resolved, read.path)
        if relation is not None:
            where = "" if read.what.endswith(str(read.path)) else f" ({read.path})"
            raise ConfigError(
                f"{flag} {shown} {relation} {read.what}{where}, which is being read; writing "
                f"there could destroy it, and no flag (--force included) allows that: choose "
                f"another {flag}, outside {read.path} and not holding it"
            )


def refuse_run_dir_over_inputs(config: Any, extra: Sequence[ReadPath] = ()) -> None:
    """Refuse a run whose `run_dir` is, lies inside or holds what its config reads (checked
    before the run directory is created or locked: the first thing a run or a dry run does)."""
    run_dir = _field(config, "run_dir")
    if run_dir:
        refuse_overlap(run_dir, "--run-dir", [*config_read_paths(config), *extra])


def checked_run_dir(config: Any) -> Path:
    """`config`'s run directory, once `refuse_run_dir_over_inputs` passed it (the first thing
    a run or a dry run does, before the directory is created or locked)."""
    refuse_run_dir_over_inputs(config)
    return Path(str(config.run_dir))
