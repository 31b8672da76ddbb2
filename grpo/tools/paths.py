"""The paths the user tools read and write: checkpoint files, owners, and where `--out` may go.

A tool writes only what it owns. `check_out` runs before any output is written and refuses,
in one line naming the flag and the fix:

- a path that is, lies inside or holds what the command reads (`reads`: its run directories,
  checkpoints, data files, found by `grpo.training.run.inputs.read_paths`), even with `--force`
  (`grpo.training.run.inputs.refuse_overlap`, the rule every command's outputs share);
- a path that exists, or that lies inside a run directory (`grpo train`'s) or a checkpoint
  directory (a PEFT adapter or a local-backend checkpoint), unless `--force`.

`terminal_safe` is the escaping every tool applies to text from data and completions before
it reaches a terminal.
"""

from __future__ import annotations

import argparse
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from grpo.training.run import run_files
from grpo.training.run.inputs import ReadPath, refuse_overlap
from grpo.training.settings.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LOCAL_METADATA = "grpo_local.json"
"""The local backend's checkpoint metadata (see grpo/backends/local/checkpoint.py)."""
LOCAL_SCHEME = "local://"

_RUN_FILES = (
    run_files.METRICS_FILE,
    run_files.CHECKPOINT_FILE,
    run_files.SUMMARY_FILE,
    run_files.BACKEND_DIR,
    run_files.LOCK_FILE,
)


def local_path(uri: str) -> Path:
    """The directory a `local://DIR` URI (or a plain path) names."""
    return Path(uri[len(LOCAL_SCHEME) :] if uri.startswith(LOCAL_SCHEME) else uri)


def owner_of(path: Path) -> tuple[str, Path] | None:
    """The run or checkpoint directory that `path` is or lies in, as (kind, directory)."""
    resolved = path.expanduser().resolve()
    for directory in (resolved, *resolved.parents):
        if (directory / run_files.CONFIG_FILE).is_file() and any(
            (directory / name).exists() for name in _RUN_FILES
        ):
            return "run directory", directory
        if (directory / LOCAL_METADATA).is_file() or (directory / ADAPTER_CONFIG).is_file():
            return "checkpoint directory", directory
    return None


def check_out(
    out: Path,
    *,
    flag: str = "--out",
    force: bool = False,
    reads: Sequence[ReadPath] = (),
    empty_dir_ok: bool = False,
) -> None:
    """Refuse `out` (ConfigError naming `flag` and the fix) where writing it could destroy data.

    Never one of `reads` (what the command reads), inside one or holding one, `force` or
    not; without `force`, never an existing path (an empty directory passes when
    `empty_dir_ok`) nor a path inside a run directory or a checkpoint directory.
    """
    resolved = out.expanduser().resolve()
    refuse_overlap(out, flag, reads)
    if force:
        return
    if out.exists() and not (empty_dir_ok and out.is_dir() and not any(out.iterdir())):
        raise ConfigError(
            f"{flag} {out} already exists; choose a new path, or pass --force to replace it"
        )
    owner = owner_of(resolved)
    if owner is not None:
        kind, directory = owner
        raise ConfigError(
            f"{flag} {out} lies inside the {kind} {directory}; write outside it, or pass "
            "--force to write there anyway"
        )


def add_force_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--force`: let `check_out` accept an existing path or one inside a run/checkpoint."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"replace an existing {what}, or write inside a run or checkpoint directory; "
        "never one that is, lies inside or holds anything this command reads (a run "
        "directory, a checkpoint, a data file), symlinks followed",
    )


_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Format characters that reorder the text shown around them (the "trojan source" ones)."""


def _unsafe(char: str) -> bool:
    return (unicodedata.category(char) == "Cc" and char not in "\n\t") or char in _BIDI_CONTROLS


def terminal_safe(text: str) -> str:
    """`text` with control characters escaped (ESC as `\\x1b`), newlines and tabs kept.

    C0/C1 controls (ESC, CR, backspace, CSI ...) and the bidirectional overrides become
    `\\xNN` / `\\uNNNN`, so data cannot move the cursor, recolour or retitle the terminal
    or reorder what it shows; every other character, printable Unicode included, passes.
    """
    return "".join(
        char.encode("unicode_escape").decode("ascii") if _unsafe(char) else char for char in text
    )
