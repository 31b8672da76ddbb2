"""The run directory: its layout and every read and write of its files.

A run directory (``runs/<name>/`` by default) is owned by one `grpo train` process at a
time and holds:

- ``config.json``: the resolved configuration (no secrets);
- ``metrics.jsonl``: one JSON row per logged step, the record of truth; every row is
  flushed and fsynced before the checkpoint that covers it is written, so a checkpoint
  never points past the last complete row;
- ``rollouts.jsonl``: up to --log-rollouts groups per step (prompt, completions, reward
  components, advantages, lengths, stop reasons), each line one group tagged with the step
  of its metrics row; written just before that row, truncated like it on resume;
- ``checkpoint.json``: the latest resumable checkpoint (step and state path; a path inside
  the run directory is stored relative to it, so a moved run directory still resumes);
- ``ahead/step-N.json``: under --max-steps-off-policy, the rollouts already sampled for
  the steps after checkpoint N, saved with it (`grpo.training.run.ahead`);
- ``reference_logprobs.json``: a recipe's cached reference log-probs, under a checksum of
  its contents (the recipe's ``reference_cache`` module);
- ``service_probe.json``: with --backend pytrio, what the loss-normalization probe measured
  at the start of the latest launch (its verdict, evidence, or why it failed);
- ``summary.json``: written when the run finished (its sampler path is read back inside
  this run directory when the run was moved or copied);
- ``trackers/``: the --log-to trackers' own files (W&B's offline runs and run id,
  TensorBoard's event files) and ``<tracker>.json``, the last step each tracker took
  (`grpo.training.trackers`);
- ``backend/``: the local backend's checkpoints; ``train.log``: output of a run launched by
  `grpo compare`/`grpo sweep`; ``.lock`` (+ ``.lock.owner``): the owner's OS file lock.

Every JSON file is written atomically (temp file, fsync, rename, fsync of the directory).
Read errors name the file, the line and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeAlias

import attrs
import filelock

from grpo.backends.files import fsync_path

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
CHECKPOINT_FILE = "checkpoint.json"
SUMMARY_FILE = "summary.json"
PROBE_FILE = "service_probe.json"
LOG_FILE = "train.log"
LOCK_FILE = ".lock"
BACKEND_DIR = "backend"
STEP_KEY = "step"

FINISHED, UNFINISHED, NEW = "finished", "unfinished", "new"

_LOCAL_SCHEME = "local://"
# The files of a local state checkpoint (grpo/backends/local/checkpoint.py).
_STATE_FILES = (
    "adapter_model.safetensors",
    "adapter_config.json",
    "optimizer.pt",
    "grpo_local.json",
)


JsonObject: TypeAlias = dict[str, object]
"""A JSON object grpo writes (a config record, a summary, a probe's verdict): its values are
serialized or passed on, never read as typed fields."""


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message names the file and the fix."""


# --- writing -------------------------------------------------------------------------------


def write_json_atomic(path: Path, payload: Mapping[str, object]) -> None:
    """Write ``payload`` as JSON via a temp file, fsync and rename: never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def payload_checksum(payload: Mapping[str, object]) -> str:
    """SHA-256 of ``payload``'s canonical JSON: what a file written by grpo stores so that a
    file edited by hand (or damaged) is not trusted (`grpo.training.run.ahead`, a recipe's
    reference cache)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _jsonable(value: object) -> object:
    """Non-finite floats become null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends rows to ``metrics.jsonl``; each row is on disk (fsynced) when ``append`` returns."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / METRICS_FILE
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def append(self, step: int, metrics: Mapping[str, object]) -> None:
        """Write ``{"step": step, **metrics}`` as one line and make it durable."""
        row = {STEP_KEY: step, **{key: _jsonable(value) for key, value in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (rows are already durable)."""
        self._file.close()


class RolloutsWriter:
    """Appends one line per logged group to ``rollouts.jsonl`` (flushed, not fsynced)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ROLLOUTS_FILE
        self._file: IO[str] | None = None

    def append(self, step: int, groups: Iterable[Mapping[str, object]]) -> None:
        """Write ``{"step": step, **group}`` for every group."""
        lines = [json.dumps({STEP_KEY: step, **group}) + "\n" for group in groups]
        if not lines:
            return
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.writelines(lines)
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


# --- reading -------------------------------------------------------------------------------


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; RunDirError naming the file and line when it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunDirError(f"{path} not found ({what})") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as error:
        raise RunDirError(
            f"{path} line {error.lineno} column {error.colno} is not valid JSON ({error.msg}); "
            f"the {what} is damaged: restore it or start a new run"
        ) from None
    if not isinstance(payload, dict):
        raise RunDirError(f"{path} holds {type(payload).__name__}, not a JSON object ({what})")
    return payload


def _optional_json(path: Path, *, what: str) -> dict[str, Any] | None:
    return read_json(path, what=what) if path.is_file() else None


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.json``; RunDirError saying it is no run directory when absent."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} is not a run directory (no {CONFIG_FILE}); "
            "give a directory made by `grpo train`"
        )
    return read_json(path, what="run configuration")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``summary.json`` (None while it has not finished), sampler path in this run.

    The sampler path goes through `_in_this_run`, so a moved or copied run directory
    points at its own weights.
    """
    summary = _optional_json(run_dir / SUMMARY_FILE, what="run summary")
    if summary is not None and isinstance(summary.get("sampler_path"), str):
        if "sampler_scheme" in summary:  # stored relative to the run directory
            record = {"state_path": summary["sampler_path"], "scheme": summary["sampler_scheme"]}
            summary["sampler_path"] = _loaded_path(run_dir, record)
        else:
            summary["sampler_path"] = _in_this_run(run_dir, summary["sampler_path"])
    return summary


def summary_sampler_path(run_dir: Path, path: str) -> dict[str, str]:
    """summary.json's ``sampler_path`` (and ``sampler_scheme``): relative when inside the run."""
    stored = _stored_path(run_dir, path)
    if "scheme" not in stored:
        return {"sampler_path": path}
    return {"sampler_path": stored["state_path"], "sampler_scheme": stored["scheme"]}


def _in_this_run(run_dir: Path, path: str) -> str:
    """A recorded absolute ``.../backend/<rest>`` path as ``run_dir/backend/<rest>`` if that exists.

    Records written before a move or ``cp -r`` of the run directory name the weights where
    they were; the run's own copy under its ``backend/`` wins. Other paths stay as given.
    """
    scheme = _LOCAL_SCHEME if path.startswith(_LOCAL_SCHEME) else ""
    plain = Path(path[len(scheme) :])
    if not plain.is_absolute() or BACKEND_DIR not in plain.parts:
        return path
    last = len(plain.parts) - 1 - plain.parts[::-1].index(BACKEND_DIR)
    here = run_dir.resolve().joinpath(*plain.parts[last:])
    return scheme + str(here) if here.exists() else path


@attrs.frozen
class Checkpoint:
    """A resumable checkpoint: the step it covers and the backend's state path."""

    step: int
    state_path: str


def _stored_path(run_dir: Path, path: str) -> dict[str, str]:
    """``path`` as stored in checkpoint.json: relative to the run dir when it points inside."""
    scheme = _LOCAL_SCHEME if path.startswith(_LOCAL_SCHEME) else ""
    plain = Path(path[len(scheme) :])
    root = run_dir.resolve()
    if plain.is_absolute() and plain.resolve().is_relative_to(root):
        return {"state_path": plain.resolve().relative_to(root).as_posix(), "scheme": scheme}
    return {"state_path": path}


def stored_state_path(run_dir: Path, path: str) -> dict[str, str]:
    """``path`` as checkpoint.json stores it: equal for a run directory that was moved since."""
    return _stored_path(run_dir, path)


def _loaded_path(run_dir: Path, record: Mapping[str, object]) -> str:
    """The state path a checkpoint.json record points at, made absolute again."""
    if "scheme" in record:
        return str(record["scheme"]) + str(run_dir.resolve() / str(record["state_path"]))
    return str(record["state_path"])


def write_checkpoint(run_dir: Path, checkpoint: Checkpoint, *, run_name: str) -> None:
    """Record ``checkpoint`` as the run's latest (atomically)."""
    write_json_atomic(
        run_dir / CHECKPOINT_FILE,
        {
            STEP_KEY: checkpoint.step,
            "run_name": run_name,
            **_stored_path(run_dir, checkpoint.state_path),
        },
    )


def read_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The run's latest checkpoint (None before the first one)."""
    path = run_dir / CHECKPOINT_FILE
    record = _optional_json(path, what="checkpoint record")
    if record is None:
        return None
    if not isinstance(record.get(STEP_KEY), int) or not isinstance(record.get("state_path"), str):
        raise RunDirError(
            f"{path} lacks an integer 'step' or a 'state_path'; the checkpoint record is "
            "damaged: restore it or start a new run"
        )
    return Checkpoint(step=record[STEP_KEY], state_path=_loaded_path(run_dir, record))


def intact_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's local ``step-N`` checkpoints on disk with every file, oldest first.

    They lie under ``run_dir/backend/<run_id>/weights/step-NNNNNN`` (`grpo/backends/local/
    checkpoint.py`); a resumed run's later ones under another run id.
    """
    found = []
    for directory in (run_dir / BACKEND_DIR).glob("*/weights/step-*"):
        match = re.fullmatch(r"step-(\d+)", directory.name)
        if match and all((directory / name).is_file() for name in _STATE_FILES):
            path = _LOCAL_SCHEME + str(directory.resolve())
            found.append(Checkpoint(step=int(match.group(1)), state_path=path))
    return sorted(found, key=lambda checkpoint: (checkpoint.step, checkpoint.state_path))


def run_status(run_dir: Path) -> str:
    """FINISHED (summary.json), UNFINISHED (a config but no summary: stopped or crashed) or NEW."""
    if (run_dir / SUMMARY_FILE).is_file():
        return FINISHED
    if (run_dir / CONFIG_FILE).is_file() or (run_dir / METRICS_FILE).is_file():
        return UNFINISHED
    return NEW


def eval_weights_path(run_dir: Path) -> str:
    """The weights `grpo eval --run-dir` uses: final sampler weights, else the last checkpoint."""
    summary = read_summary(run_dir)
    if summary is not None and summary.get("sampler_path"):
        return str(summary["sampler_path"])
    checkpoint = read_checkpoint(run_dir)
    if checkpoint is None:
        raise RunDirError(
            f"{run_dir} has no {SUMMARY_FILE} or {CHECKPOINT_FILE} yet: nothing to evaluate"
        )
    return checkpoint.state_path


@attrs.frozen
class MetricsRead:
    """The valid rows of a metrics.jsonl, and the 1-based line numbers that were not rows."""

    rows: list[dict[str, Any]]
    bad_lines: tuple[int, ...]
    truncated_tail: bool
    """The last line was cut off (no newline, not JSON): what a crash mid-write leaves."""


def scan_metrics(path: Path) -> MetricsRead:
    """Parse every line of a metrics.jsonl; damaged lines are reported by number, not dropped."""
    if not path.is_file():
        return MetricsRead(rows=[], bad_lines=(), truncated_tail=False)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        if not isinstance(row, dict) or not isinstance(row.get(STEP_KEY), int):
            bad.append(number)
            continue
        rows.append(row)
    truncated = bool(bad) and bad[-1] == len(lines) and not ends_with_newline
    return MetricsRead(rows=rows, bad_lines=tuple(bad), truncated_tail=truncated)


def _read_rows(path: Path, what: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file of the run; RunDirError names a damaged line.

    A cut-off last line (what a crash mid-write leaves) is skipped, not reported.
    """
    scanned = scan_metrics(path)
    damaged = scanned.bad_lines[:-1] if scanned.truncated_tail else scanned.bad_lines
    if damaged:
        raise RunDirError(
            f"{path} line {damaged[0]} is not a {what} (JSON with an integer 'step'); "
            "repair or delete that line"
        )
    return scanned.rows


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (see `_read_rows`)."""
    return _read_rows(run_dir / METRICS_FILE, "metrics row")


def merge_rows_by_step(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, in step order, each key keeping its latest non-null value.

    A final-evaluation row shares its step with the last training row; null values
    (non-finite floats in the log) are dropped as missing.
    """
    merged: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = row.get(STEP_KEY)
        if not isinstance(step, int) or isinstance(step, bool):
            raise RunDirError(f"metrics row without an integer {STEP_KEY!r}: {dict(row)!r}")
        merged.setdefault(step, {STEP_KEY: step}).update(
            {key: value for key, value in row.items() if value is not None}
        )
    return [merged[step] for step in sorted(merged)]


def rewrite_metrics(run_dir: Path, rows: Sequence[Mapping[str, object]]) -> None:
    """Replace metrics.jsonl with ``rows`` atomically (used when a resume drops redone steps)."""
    path = run_dir / METRICS_FILE
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(dict(row)) + "\n" for row in rows)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(run_dir)


def prepare_metrics_for_resume(run_dir: Path, checkpoint_step: int | None) -> int:
    """Keep exactly the rows a resume from ``checkpoint_step`` does not redo; return rows dropped.

    Without a checkpoint the run restarts from step 0, so every row goes (including a
    baseline evaluation at step 0, which is redone). With one at step k, rows of steps
    <= k stay, and the rows of steps 1..k must all be there: a damaged line among them is
    reported by number (it cannot be redone from this checkpoint), never dropped.
    """
    path = run_dir / METRICS_FILE
    scanned = scan_metrics(path)
    if checkpoint_step is None:
        if path.exists():
            rewrite_metrics(run_dir, [])
        return len(scanned.rows)
    damaged = scanned.bad_lines[:-1] if scanned.truncated_tail else scanned.bad_lines
    kept = [row for row in scanned.rows if row[STEP_KEY] <= checkpoint_step]
    covered = {row[STEP_KEY] for row in kept}
    missing = [step for step in range(1, checkpoint_step + 1) if step not in covered]
    if damaged or missing:
        where = f"line {damaged[0]} is damaged" if damaged else f"step {missing[0]} has no row"
        raise RunDirError(
            f"{path}: {where}, but the checkpoint covers steps up to {checkpoint_step}; those "
            "rows cannot be redone from it. Repair the line from a backup, or delete "
            f"{CHECKPOINT_FILE} to rerun the whole run in place"
        )
    rewrite_metrics(run_dir, kept)
    return len(scanned.rows) - len(kept)


def read_rollouts(run_dir: Path) -> list[dict[str, Any]]:
    """The groups of a run's rollouts.jsonl ([] when absent; see `_read_rows`)."""
    return _read_rows(run_dir / ROLLOUTS_FILE, "rollout record")


def prepare_rollouts_for_resume(run_dir: Path, checkpoint_step: int | None) -> int:
    """Keep the groups of steps <= ``checkpoint_step`` (none without one); return lines dropped.

    Rollouts are a readable log, not a record of truth: damaged lines are dropped too.
    """
    path = run_dir / ROLLOUTS_FILE
    if not path.exists():
        return 0
    scanned = scan_metrics(path)
    limit = -1 if checkpoint_step is None else checkpoint_step
    kept = [row for row in scanned.rows if row[STEP_KEY] <= limit]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in kept)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return len(scanned.rows) + len(scanned.bad_lines) - len(kept)


# --- ownership -----------------------------------------------------------------------------


def _owner_description(owner_path: Path) -> str:
    try:
        owner = json.loads(owner_path.read_text(encoding="utf-8"))
        return f"pid {owner['pid']} on {owner['host']}, since {owner['since']}: {owner['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextmanager
def owned(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's OS file lock while the block runs; RunDirError if it is taken.

    The lock is the kernel's (``flock`` through `filelock`): it is released when the
    process exits in any way, so a killed run never leaves a stale lock. A block that
    leaves the directory holding nothing but the lock (a check failed before the run
    wrote anything) removes the lock file and the directories this call created.
    """
    created = [directory for directory in (run_dir, *run_dir.parents) if not directory.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / LOCK_FILE
    new_lock = not lock_path.exists()
    owner_path = run_dir / (LOCK_FILE + ".owner")
    lock = filelock.FileLock(lock_path, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise RunDirError(
            f"{run_dir} is in use by {_owner_description(owner_path)}; wait for that run to "
            "end, or use another --run-dir / --run-name"
        ) from None
    try:
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        owner_path.write_text(json.dumps(owner), encoding="utf-8")
        yield
    finally:
        owner_path.unlink(missing_ok=True)
        # Unlinked while still held, so a process that opened it meanwhile is refused.
        if new_lock and [entry.name for entry in run_dir.iterdir()] == [LOCK_FILE]:
            lock_path.unlink(missing_ok=True)
        lock.release()
        for directory in created:  # innermost first; stops at the first one not empty
            try:
                directory.rmdir()
            except OSError:
                break
