"""Launching the runs of an experiment: plans, validation before launch, skip / resume / start.

- planning: a `RunSpec` per run, one run directory `OUT/<label>-seed<k>` each; every run's
  `TrainConfig` is built (and so validated) before any run starts, so a bad flag is one
  error naming the run and the flag, never a failure inside a subprocess;
- execution: `execute_runs` skips finished runs (summary.json), resumes unfinished ones
  (config.json, no summary.json) with `--resume`, starts the rest, `--jobs` at a time, each
  with its output in the run's train.log; an interrupted experiment resumes by rerunning it;
- stopping: SIGINT or SIGTERM to the experiment is forwarded to every running trainer (each
  stops with a checkpoint), no new one starts, and the experiment waits for them.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import attrs

from grpo.training.run import run_files
from grpo.training.run.inputs import ReadPath, config_read_paths, refuse_overlap
from grpo.training.run.run_files import FINISHED, NEW, UNFINISHED
from grpo.training.settings.config import (
    ConfigError,
    TrainConfig,
    check_user_inputs,
    config_from_dict,
)
from grpo.training.settings.flags import checked_overrides, train_argv

TRAIN_COMMAND: tuple[str, ...] = (sys.executable, "-m", "grpo", "train")
DEFAULT_JOBS = 2
# Compare and sweep set these per run (the run directory and its seed); users may not.
MANAGED_FLAGS = frozenset({"seed", "run_dir", "run_name"})
# A trainer's output goes to its train.log: progress bars (tqdm's own, the hub's downloads)
# redraw with carriage returns and would leave fragments there, so they are turned off.
QUIET_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def normalize_overrides(raw: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Flag overrides with underscore keys, each checked by its field, none of MANAGED_FLAGS.

    A `loss_config` table `{clip_high_threshold = 1.28}` becomes `("clip_high_threshold=1.28",)`.
    """
    for key in raw:
        name = key.replace("-", "_")
        if name in MANAGED_FLAGS:
            raise ConfigError(
                f"{where}: {name!r} is set per run by compare/sweep "
                "(run directory OUT/<label>-seed<k>); "
                "remove it (choose seeds with --seeds or `seeds = [...]`)"
            )
    return checked_overrides(raw, where=where)


@attrs.frozen
class RunSpec:
    """One run of an experiment: its configuration label, seed, directory and every flag it sets."""

    label: str
    seed: int
    run_dir: Path
    overrides: Mapping[str, Any]


def run_dir_name(label: str, seed: int) -> str:
    """`<label>-seed<k>`, with characters unsafe in a path replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", label) + f"-seed{seed}"


def planned_configs(
    specs: Sequence[RunSpec], *, out: Path | None = None, reads: Sequence[ReadPath] = ()
) -> list[TrainConfig]:
    """The validated TrainConfig of every planned run; ConfigError naming the run and the flag.

    The experiment directory `out` (which holds every run directory) is refused when it is,
    lies inside or holds `reads` (its TOML files) or anything a planned run reads.
    """
    if out is not None:
        refuse_overlap(out, "--out", reads)
    configs = []
    for spec in specs:
        values = {**spec.overrides, "run_dir": str(spec.run_dir)}
        configs.append(config_from_dict(values, where=f"run {spec.run_dir}"))
        if out is not None:
            refuse_overlap(out, "--out", config_read_paths(configs[-1], f"run {spec.run_dir}: "))
        check_user_inputs(configs[-1], where=f"run {spec.run_dir}")
    return configs


def launch_command(spec: RunSpec, status: str, train_command: Sequence[str]) -> list[str]:
    """The subprocess argv: `--resume DIR` for an unfinished run, the full flags for a new one."""
    if status == UNFINISHED:
        return [*train_command, "--resume", str(spec.run_dir)]
    if status == NEW:
        return [*train_command, *train_argv(spec.overrides), "--run-dir", str(spec.run_dir)]
    raise ValueError(f"run {spec.run_dir} is {status}; only new or unfinished runs are launched")


def _same_setting(requested: Any, recorded: Any) -> bool:
    if isinstance(requested, (list, tuple)):
        return isinstance(recorded, (list, tuple)) and [str(item) for item in requested] == [
            str(item) for item in recorded
        ]
    if (
        isinstance(requested, (int, float))
        and isinstance(recorded, (int, float))
        and not isinstance(requested, bool)
    ):
        return math.isclose(requested, recorded, rel_tol=1e-9, abs_tol=0.0)
    return requested == recorded


def check_existing_run(spec: RunSpec) -> None:
    """Refuse to skip or resume a run directory whose saved config differs from the request."""
    recorded = run_files.read_config(spec.run_dir)
    # A key the saved config lacks cannot be checked (the trainer may leave some out); the
    # tracker group follows the experiment directory's name, which a moved experiment changes.
    differences = [
        f"{name}: {recorded[name]!r} there, {value!r} requested"
        for name, value in spec.overrides.items()
        if name in recorded and name != "tracker_group" and not _same_setting(value, recorded[name])
    ]
    if differences:
        raise ValueError(
            f"{spec.run_dir} holds a run with other settings ({'; '.join(differences)}); "
            "use another --out, or delete that directory to rerun it"
        )


def check_run_dirs(specs: Sequence[RunSpec]) -> None:
    """ValueError when two runs would share a directory (their labels differ only in
    characters a directory name replaces), or an existing run directory holds a run with
    other settings; the real experiment and its --dry-run both check this."""
    first: dict[Path, RunSpec] = {}
    for spec in specs:
        other = first.setdefault(spec.run_dir.resolve(), spec)
        if other is not spec:
            raise ValueError(
                f"the configurations {other.label!r} and {spec.label!r} (seed {spec.seed}) "
                f"would share the run directory {spec.run_dir} (a name keeps A-Z a-z 0-9 and "
                "._=,+- and turns every other character into '_'); give them names that "
                "differ in those characters"
            )
    for spec in specs:
        if run_files.run_status(spec.run_dir) != NEW:
            check_existing_run(spec)


@attrs.frozen
class RunOutcome:
    """What `execute_runs` did with a run: "skipped" (already finished), "started" or "resumed"."""

    spec: RunSpec
    action: str
    returncode: int | None
    seconds: float


class Trainers:
    """The trainer subprocesses running now; a stop request is passed on to each of them.

    Each trainer has its own session, so a terminal's Ctrl-C reaches the experiment only and
    is passed on once (a second SIGINT to a trainer aborts it without a checkpoint).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()
        self.stop_signal: int | None = None

    def run(
        self,
        command: Sequence[str],
        log: IO[str],
        env: Mapping[str, str],
        on_start: Callable[[], None] = lambda: None,
    ) -> int | None:
        """Run one trainer to its end (None: not started, the experiment is stopping);
        ``on_start`` is called once its process runs."""
        with self._lock:
            if self.stop_signal is not None:
                return None
            process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
            self._live.add(process)
        on_start()
        try:
            return process.wait()
        finally:
            with self._lock:
                self._live.discard(process)

    def forward(self, signum: int) -> None:
        """Start no new trainer; send `signum` to every running one (each saves a checkpoint)."""
        with self._lock:
            self.stop_signal = signum
            for process in self._live:
                if process.poll() is None:
                    process.send_signal(signum)


@contextmanager
def forwarding_signals(trainers: Trainers) -> Iterator[None]:
    """SIGINT and SIGTERM to the experiment are forwarded to its trainers (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: trainers.forward(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _launch(
    spec: RunSpec,
    status: str,
    train_command: Sequence[str],
    env: Mapping[str, str],
    trainers: Trainers,
    on_start: Callable[[], None],
) -> RunOutcome:
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    command = launch_command(spec, status, train_command)
    start = time.monotonic()
    with (spec.run_dir / run_files.LOG_FILE).open("a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        returncode = trainers.run(command, log, env, on_start)
    action = "resumed" if status == UNFINISHED else "started"
    if returncode is None:
        action = "not started"
    return RunOutcome(
        spec=spec, action=action, returncode=returncode, seconds=time.monotonic() - start
    )


def execute_runs(
    specs: Sequence[RunSpec],
    *,
    jobs: int,
    train_command: Sequence[str] = TRAIN_COMMAND,
    echo: Callable[[str], None] = print,
) -> list[RunOutcome]:
    """Run every spec not yet finished, `jobs` subprocesses at a time; outcomes in spec order.

    Every existing run directory is checked against its spec before anything starts. Each
    run is announced when its trainer actually starts (`start`/`resume`), and as each ends
    `done N/M` (or `FAILED N/M`): N runs of the M to run have ended.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    check_run_dirs(specs)
    statuses = [run_files.run_status(spec.run_dir) for spec in specs]
    # Parallel trainers each using every core would oversubscribe the CPUs.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    env.update(QUIET_BARS)
    outcomes: dict[int, RunOutcome] = {}
    pending = []
    for index, (spec, status) in enumerate(zip(specs, statuses, strict=True)):
        if status == FINISHED:
            outcomes[index] = RunOutcome(spec=spec, action="skipped", returncode=None, seconds=0.0)
            echo(f"skip   {spec.run_dir} (finished)")
        else:
            pending.append((index, spec, status))
    trainers = Trainers()
    echo_lock = threading.Lock()  # runs start on the pool's threads

    def announce(spec: RunSpec, status: str) -> Callable[[], None]:
        def started() -> None:
            with echo_lock:
                echo(
                    f"{'resume' if status == UNFINISHED else 'start '} {spec.run_dir} "
                    f"(log: {spec.run_dir / run_files.LOG_FILE})"
                )

        return started

    ended, total = 0, len(pending)
    with forwarding_signals(trainers), ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(
                _launch, spec, status, train_command, env, trainers, announce(spec, status)
            ): index
            for index, spec, status in pending
        }
        try:
            for future in as_completed(futures):
                outcome = future.result()
                outcomes[futures[future]] = outcome
                if outcome.returncode is None:
                    continue
                ended += 1
                if outcome.returncode == 0:
                    verdict = f"done {ended}/{total}"
                elif run_files.run_status(outcome.spec.run_dir) == FINISHED:
                    # The run's results are complete; only the process's exit went wrong.
                    verdict = f"done {ended}/{total}, then exit {outcome.returncode}:"
                else:
                    verdict = f"FAILED {ended}/{total} (exit {outcome.returncode})"
                with echo_lock:
                    echo(f"{verdict} {outcome.spec.run_dir} in {outcome.seconds:.1f}s")
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()
            trainers.forward(signal.SIGINT)
            raise
    if trainers.stop_signal is not None:
        # Every running trainer got the signal and saved a checkpoint; nothing new started.
        echo(
            f"stopped by {signal.Signals(trainers.stop_signal).name}: the running trainers saved "
            "checkpoints, no new runs started; rerun the same command to resume"
        )
        raise KeyboardInterrupt
    ordered = [outcomes[index] for index in range(len(specs))]
    counts = {
        action: sum(outcome.action == action for outcome in ordered)
        for action in ("skipped", "resumed", "started")
    }
    failed = sum(
        outcome.returncode not in (None, 0)
        and run_files.run_status(outcome.spec.run_dir) != FINISHED
        for outcome in ordered
    )
    echo(
        f"runs: {counts['started']} started, {counts['resumed']} resumed, "
        f"{counts['skipped']} skipped (finished); {failed} failed"
    )
    return ordered
