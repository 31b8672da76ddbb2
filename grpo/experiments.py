"""Experiments as one command: `grpo compare` (losses x seeds) and `grpo sweep` (a grid or list
of flag overrides x seeds), each run a `grpo train` subprocess, then a report and plots.

Three layers, so the numbers are testable without processes or pictures:
- planning (pure): flags -> `RunSpec`s, one run directory `OUT/<label>-seed<k>` each;
- execution (side effects): `execute_runs` skips finished runs (summary.json), resumes
  unfinished ones (config.json, no summary.json) with `--resume`, starts the rest, `--jobs` at
  a time, each with its output in `train.log`; an interrupted experiment resumes by rerunning it;
- reporting (pure until written): run dirs -> `RunStats` -> `ConfigSummary` (mean ± sample std
  over seeds) -> report.md, a JSON file with the same numbers, and band plots.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import attrs
from matplotlib.figure import Figure

from grpo.config import FIELD_NAMES, TrainConfig, check_keys, load_toml
from grpo.plots import (
    METRICS_FILE,
    band_figure,
    metric_keys,
    metric_series,
    read_run_metrics,
    save_figure,
)

TRAIN_COMMAND: tuple[str, ...] = (sys.executable, "-m", "grpo", "train")
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
LOG_FILE = "train.log"
DEFAULT_JOBS = 2
DEFAULT_LAST_STEPS = 5
# Compare and sweep set these per run (the run directory and its seed); users may not.
MANAGED_FLAGS = frozenset({"seed", "run_dir", "run_name"})
# A run was on-policy when no token's ratio left 1 ± RATIO_TOLERANCE; the clip-based losses
# reduce to importance sampling when at most CLIP_TOLERANCE of the tokens were ever clipped.
RATIO_TOLERANCE = 1e-3
CLIP_TOLERANCE = 1e-3
# The kernels whose gradient is r·A on every unclipped token, so zero clipping makes them equal.
CLIP_EQUIVALENT_LOSSES = frozenset({"importance_sampling", "ppo", "cispo"})

_FIELDS = {field.name: field for field in attrs.fields(attrs.resolve_types(TrainConfig))}


# --- train flags ---------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(name: str) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed)."""
    annotation = _FIELDS[name].type
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        non_none = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return non_none[0], True
    return annotation, False


def add_train_flag_arguments(parser: argparse.ArgumentParser, *, exclude: Iterable[str]) -> None:
    """Add every `grpo train` flag but `exclude` as an optional argument; unset ones stay absent from args."""
    excluded = set(exclude)
    group = parser.add_argument_group("train flags, passed to every run (see `grpo train --help`)")
    for name, field in _FIELDS.items():
        if name in excluded:
            continue
        base, _ = _field_type(name)
        help_text = f"{field.metadata['help']} (default: {field.default!r})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:
            kwargs.update(action="append", metavar="KEY=VALUE")
        else:
            kwargs.update(type=base, choices=field.metadata.get("choices"))
        group.add_argument(_flag(name), **kwargs)


def train_flags_from_args(args: argparse.Namespace, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The train flags the user set on the command line (those `add_train_flag_arguments` added)."""
    excluded = set(exclude)
    return {name: getattr(args, name) for name in _FIELDS if name not in excluded and hasattr(args, name)}


def normalize_overrides(raw: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Flag overrides with underscore keys, validated: known flag, not managed, value of the flag's type.

    A `loss_config` table `{clip_high_threshold = 1.28}` becomes `["clip_high_threshold=1.28"]`.
    """
    overrides = {key.replace("-", "_"): value for key, value in raw.items()}
    check_keys(overrides, where=where)
    for name, value in overrides.items():
        if name in MANAGED_FLAGS:
            raise ValueError(
                f"{where}: {name!r} is set per run by compare/sweep (run directory OUT/<label>-seed<k>); "
                "remove it (choose seeds with --seeds or `seeds = [...]`)"
            )
        if name == "loss_config" and isinstance(value, Mapping):
            value = [f"{key}={item}" for key, item in value.items()]
        overrides[name] = _checked_value(name, value, where=where)
    return overrides


def _checked_value(name: str, value: Any, *, where: str) -> Any:
    """`value` if it fits flag `name`'s type (ints accepted for floats), else a ValueError saying which type."""
    base, optional = _field_type(name)
    if value is None and optional:
        return None
    if typing.get_origin(base) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return tuple(value)
        expected = "a list of KEY=VALUE strings (or a table)"
    elif base is bool:
        if isinstance(value, bool):
            return value
        expected = "true or false"
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        expected = "a number"
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        expected = "an integer"
    else:
        if isinstance(value, str):
            choices = _FIELDS[name].metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{where}: {name} = {value!r} is not one of {', '.join(choices)}")
            return value
        expected = "a string"
    raise ValueError(f"{where}: {name} = {value!r} must be {expected} ({_flag(name)})")


def train_argv(overrides: Mapping[str, Any]) -> list[str]:
    """The `grpo train` arguments that set each field of `overrides` (fields not listed keep their defaults).

    Booleans are switches (`--custom-loss`; False is the absent switch, or `--no-fewshot` for a
    field whose default is not False); sequences repeat the flag; None leaves a None default.
    """
    argv: list[str] = []
    for name, value in overrides.items():
        if name not in _FIELDS:
            raise ValueError(f"unknown train flag {name!r}")
        default = _FIELDS[name].default
        if isinstance(value, bool):
            if value:
                argv.append(_flag(name))
            elif default is not False:
                argv.append("--no-" + name.replace("_", "-"))
        elif value is None:
            if default is not None:
                raise ValueError(f"{name} = None: {_flag(name)} needs a value (its default is {default!r})")
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [_flag(name), str(item)]
        else:
            argv += [_flag(name), str(value)]
    return argv


# --- planning ------------------------------------------------------------------------------


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


def compare_specs(loss_fns: Sequence[str], seeds: Sequence[int], shared: Mapping[str, Any], out: Path) -> list[RunSpec]:
    """One run per loss x seed, in `out/<loss>-seed<k>`, all with the `shared` flags."""
    return [
        RunSpec(
            label=loss_fn,
            seed=seed,
            run_dir=out / run_dir_name(loss_fn, seed),
            overrides={**shared, "loss_fn": loss_fn, "seed": seed},
        )
        for loss_fn in loss_fns
        for seed in seeds
    ]


# --- execution -----------------------------------------------------------------------------

FINISHED, UNFINISHED, NEW = "finished", "unfinished", "new"


def run_status(run_dir: Path) -> str:
    """The run's state: FINISHED (summary.json), UNFINISHED (config.json only: crashed or killed) or NEW."""
    if (run_dir / SUMMARY_FILE).is_file():
        return FINISHED
    if (run_dir / CONFIG_FILE).is_file():
        return UNFINISHED
    return NEW


def launch_command(spec: RunSpec, status: str, train_command: Sequence[str]) -> list[str]:
    """The subprocess argv: `--resume DIR` for an unfinished run, the full flags for a new one."""
    if status == UNFINISHED:
        return [*train_command, "--resume", str(spec.run_dir)]
    if status == NEW:
        return [*train_command, *train_argv(spec.overrides), "--run-dir", str(spec.run_dir)]
    raise ValueError(f"run {spec.run_dir} is {status}; only new or unfinished runs are launched")


def _same_setting(requested: Any, recorded: Any) -> bool:
    if isinstance(requested, (list, tuple)):
        return isinstance(recorded, (list, tuple)) and [str(item) for item in requested] == [str(item) for item in recorded]
    if isinstance(requested, (int, float)) and isinstance(recorded, (int, float)) and not isinstance(requested, bool):
        return math.isclose(requested, recorded, rel_tol=1e-9, abs_tol=0.0)
    return requested == recorded


def check_existing_run(spec: RunSpec) -> None:
    """Refuse to skip or resume a run directory whose config.json has other settings than requested."""
    path = spec.run_dir / CONFIG_FILE
    recorded = json.loads(path.read_text())
    # A key config.json lacks cannot be checked (the trainer may leave some out), only a differing one.
    differences = [
        f"{name}: {recorded[name]!r} there, {value!r} requested"
        for name, value in spec.overrides.items()
        if name in recorded and not _same_setting(value, recorded[name])
    ]
    if differences:
        raise ValueError(
            f"{spec.run_dir} holds a run with other settings ({'; '.join(differences)}); "
            "use another --out, or delete that directory to rerun it"
        )


@attrs.frozen
class RunOutcome:
    """What `execute_runs` did with a run: "skipped" (already finished), "started" or "resumed"."""

    spec: RunSpec
    action: str
    returncode: int | None
    seconds: float


def _launch(spec: RunSpec, status: str, train_command: Sequence[str], env: Mapping[str, str]) -> RunOutcome:
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    command = launch_command(spec, status, train_command)
    start = time.monotonic()
    with (spec.run_dir / LOG_FILE).open("a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env), check=False)
    action = "resumed" if status == UNFINISHED else "started"
    return RunOutcome(spec=spec, action=action, returncode=completed.returncode, seconds=time.monotonic() - start)


def execute_runs(
    specs: Sequence[RunSpec],
    *,
    jobs: int,
    train_command: Sequence[str] = TRAIN_COMMAND,
    echo: Callable[[str], None] = print,
) -> list[RunOutcome]:
    """Run every spec not yet finished, `jobs` subprocesses at a time; outcomes in spec order.

    Every existing run directory is checked against its spec before anything starts.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    directories = [spec.run_dir.resolve() for spec in specs]
    shared = sorted({str(path) for path in directories if directories.count(path) > 1})
    if shared:
        raise ValueError(f"two runs would share the directory {shared[0]}; give the configurations distinct labels")
    statuses = [run_status(spec.run_dir) for spec in specs]
    for spec, status in zip(specs, statuses, strict=True):
        if status != NEW:
            check_existing_run(spec)
    # Parallel trainers each using every core would oversubscribe the CPUs.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    outcomes: dict[int, RunOutcome] = {}
    pending = []
    for index, (spec, status) in enumerate(zip(specs, statuses, strict=True)):
        if status == FINISHED:
            outcomes[index] = RunOutcome(spec=spec, action="skipped", returncode=None, seconds=0.0)
            echo(f"skip   {spec.run_dir} (finished)")
        else:
            pending.append((index, spec, status))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {}
        for index, spec, status in pending:
            echo(f"{'resume' if status == UNFINISHED else 'start '} {spec.run_dir} (log: {spec.run_dir / LOG_FILE})")
            futures[pool.submit(_launch, spec, status, train_command, env)] = index
        try:
            for future in as_completed(futures):
                outcome = future.result()
                outcomes[futures[future]] = outcome
                if outcome.returncode == 0:
                    verdict = "done  "
                elif run_status(outcome.spec.run_dir) == FINISHED:
                    # The run's results are complete; only the process's exit went wrong.
                    verdict = f"done, then exit {outcome.returncode}:"
                else:
                    verdict = f"FAILED (exit {outcome.returncode})"
                echo(f"{verdict} {outcome.spec.run_dir} in {outcome.seconds:.1f}s")
        except KeyboardInterrupt:
            # Ctrl-C reaches the trainers too (same process group): each saves a checkpoint.
            # Start nothing new; rerunning the same command resumes every unfinished run.
            for future in futures:
                future.cancel()
            echo("interrupted: no new runs started; rerun the same command to resume")
            raise
    ordered = [outcomes[index] for index in range(len(specs))]
    counts = {action: sum(outcome.action == action for outcome in ordered) for action in ("skipped", "resumed", "started")}
    failed = sum(outcome.returncode not in (None, 0) and run_status(outcome.spec.run_dir) != FINISHED for outcome in ordered)
    echo(f"runs: {counts['started']} started, {counts['resumed']} resumed, {counts['skipped']} skipped (finished); {failed} failed")
    return ordered


# --- reading runs and statistics -------------------------------------------------------------


@attrs.frozen
class RunData:
    """What a run directory holds: config.json ({} if absent), merged metrics rows, summary.json (None if unfinished)."""

    run_dir: Path
    config: Mapping[str, Any]
    rows: list[dict[str, Any]]
    summary: Mapping[str, Any] | None


def read_run(run_dir: str | Path) -> RunData:
    """Read a run directory, whatever state it is in (a run that failed early may hold nothing)."""
    directory = Path(run_dir)
    config_path, summary_path = directory / CONFIG_FILE, directory / SUMMARY_FILE
    return RunData(
        run_dir=directory,
        config=json.loads(config_path.read_text()) if config_path.is_file() else {},
        rows=read_run_metrics(directory) if (directory / METRICS_FILE).is_file() else [],
        summary=json.loads(summary_path.read_text()) if summary_path.is_file() else None,
    )


def final_value(run: RunData, metric: str, last_steps: int) -> float | None:
    """A run's final value of `metric`.

    `test/*`: the final evaluation (summary.json's value, else the last logged one);
    any other metric: the mean of its last `last_steps` logged values. None if never logged.
    """
    if metric.startswith("test/"):
        if run.summary is not None and run.summary.get(metric) is not None:
            return float(run.summary[metric])
        _, values = metric_series(run.rows, metric)
        return float(values[-1]) if values.size else None
    _, values = metric_series(run.rows, metric)
    return float(values[-last_steps:].mean()) if values.size else None


def _loss_prefix(run: RunData) -> str | None:
    """The prefix of the run's loss metrics: its loss_fn, or the one its metrics use."""
    if run.config.get("loss_fn"):
        return str(run.config["loss_fn"])
    prefixes = sorted({key.split("/", 1)[0] for key in metric_keys(run.rows) if key.endswith("/clip_fraction")})
    return prefixes[0] if prefixes else None


def _series_reduce(run: RunData, key: str | None, reduce: Callable[[Any], Any]) -> float | None:
    if key is None:
        return None
    _, values = metric_series(run.rows, key)
    return float(reduce(values)) if values.size else None


def steps_per_second(run: RunData) -> float | None:
    """summary steps / wall_time_s; for an unfinished run, 1 / mean of `time/step`."""
    if run.summary and run.summary.get("wall_time_s") and run.summary.get("steps"):
        return float(run.summary["steps"]) / float(run.summary["wall_time_s"])
    seconds = _series_reduce(run, "time/step", lambda values: values.mean())
    return 1.0 / seconds if seconds else None


@attrs.frozen
class RunStats:
    """The report's numbers for one run; loss statistics are means over the logged steps,
    except ratio_min / ratio_max, the extremes over the whole run."""

    name: str
    label: str
    seed: int
    loss_fn: str | None
    finished: bool
    steps: int
    train_reward: float | None
    test_reward: float | None
    steps_per_s: float | None
    clip_fraction: float | None
    clip_low_fraction: float | None
    clip_high_fraction: float | None
    ratio_mean: float | None
    ratio_min: float | None
    ratio_max: float | None

    @property
    def max_ratio_deviation(self) -> float | None:
        """max |r − 1| over every logged token of the run."""
        if self.ratio_min is None or self.ratio_max is None:
            return None
        return max(abs(self.ratio_min - 1.0), abs(self.ratio_max - 1.0))


def run_stats(run: RunData, *, label: str, seed: int, last_steps: int) -> RunStats:
    """The per-run numbers of the report, computed from the run's metrics and summary."""
    prefix = _loss_prefix(run)

    def loss_key(name: str) -> str | None:
        return f"{prefix}/{name}" if prefix else None

    steps, _ = metric_series(run.rows, "reward")
    return RunStats(
        name=run.run_dir.name,
        label=label,
        seed=seed,
        loss_fn=run.config.get("loss_fn"),
        finished=run.summary is not None,
        steps=int(steps.max()) if steps.size else 0,
        train_reward=final_value(run, "reward", last_steps),
        test_reward=final_value(run, "test/reward", last_steps),
        steps_per_s=steps_per_second(run),
        clip_fraction=_series_reduce(run, loss_key("clip_fraction"), lambda values: values.mean()),
        clip_low_fraction=_series_reduce(run, loss_key("clip_low_fraction"), lambda values: values.mean()),
        clip_high_fraction=_series_reduce(run, loss_key("clip_high_fraction"), lambda values: values.mean()),
        ratio_mean=_series_reduce(run, loss_key("ratio_mean"), lambda values: values.mean()),
        ratio_min=_series_reduce(run, loss_key("ratio_min"), lambda values: values.min()),
        ratio_max=_series_reduce(run, loss_key("ratio_max"), lambda values: values.max()),
    )


@attrs.frozen
class Stat:
    """Mean and sample standard deviation (ddof 1; None for a single value) of the values present."""

    mean: float | None
    std: float | None
    n: int

    def format(self, digits: int = 3) -> str:
        """The stat as `mean ± std`, the mean alone for one value, "–" for none."""
        if self.mean is None:
            return "–"
        if self.std is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


def mean_std(values: Iterable[float | None]) -> Stat:
    """Stat of the non-None values: mean Σx/n and sample std sqrt(Σ(x − mean)²/(n − 1))."""
    present = [float(value) for value in values if value is not None]
    count = len(present)
    if count == 0:
        return Stat(mean=None, std=None, n=0)
    mean = sum(present) / count
    std = math.sqrt(sum((value - mean) ** 2 for value in present) / (count - 1)) if count > 1 else None
    return Stat(mean=mean, std=std, n=count)


@attrs.frozen
class ConfigSummary:
    """One configuration (a loss, or a sweep point) over its seeds."""

    label: str
    runs: tuple[RunStats, ...]
    train_reward: Stat
    test_reward: Stat
    steps_per_s: Stat
    clip_fraction: Stat
    clip_low_fraction: Stat
    clip_high_fraction: Stat
    ratio_mean: Stat
    ratio_min: float | None
    ratio_max: float | None

    @property
    def finished(self) -> int:
        """How many of its runs finished."""
        return sum(run.finished for run in self.runs)


def summarize(label: str, runs: Sequence[RunStats]) -> ConfigSummary:
    """Aggregate a configuration's runs: mean ± std of each number, extremes of the ratio."""
    minima = [run.ratio_min for run in runs if run.ratio_min is not None]
    maxima = [run.ratio_max for run in runs if run.ratio_max is not None]
    return ConfigSummary(
        label=label,
        runs=tuple(runs),
        train_reward=mean_std(run.train_reward for run in runs),
        test_reward=mean_std(run.test_reward for run in runs),
        steps_per_s=mean_std(run.steps_per_s for run in runs),
        clip_fraction=mean_std(run.clip_fraction for run in runs),
        clip_low_fraction=mean_std(run.clip_low_fraction for run in runs),
        clip_high_fraction=mean_std(run.clip_high_fraction for run in runs),
        ratio_mean=mean_std(run.ratio_mean for run in runs),
        ratio_min=min(minima) if minima else None,
        ratio_max=max(maxima) if maxima else None,
    )


def summarize_by_label(stats: Sequence[RunStats]) -> list[ConfigSummary]:
    """A ConfigSummary per label, in order of first appearance."""
    labels = list(dict.fromkeys(run.label for run in stats))
    return [summarize(label, [run for run in stats if run.label == label]) for label in labels]


def on_policy_warning(stats: Sequence[RunStats]) -> str | None:
    """The report's warning when the runs were too on-policy for the losses to differ, else None.

    Every kernel's gradient is A·∇lp at r = 1, so runs whose ratios never left 1 ± RATIO_TOLERANCE
    are the same algorithm; IS, PPO and CISPO also coincide (gradient r·A) while nothing is clipped.
    """
    deviations = [run.max_ratio_deviation for run in stats if run.max_ratio_deviation is not None]
    clip_fractions = [run.clip_fraction for run in stats if run.clip_fraction is not None]
    losses = {run.loss_fn for run in stats if run.loss_fn}
    max_deviation = max(deviations) if deviations else None
    max_clip = max(clip_fractions) if clip_fractions else None
    ratio_is_one = max_deviation is not None and max_deviation <= RATIO_TOLERANCE
    never_clipped = (
        max_clip is not None and max_clip <= CLIP_TOLERANCE and bool(losses) and losses <= CLIP_EQUIVALENT_LOSSES
    )
    if not (ratio_is_one or never_clipped):
        return None
    deviation_text = f"{max_deviation:.2g}" if max_deviation is not None else "not logged"
    clip_text = f"{max_clip:.2%}" if max_clip is not None else "not logged"
    return (
        "**WARNING: these runs were too on-policy for the losses to differ.** "
        f"Over all runs, max |ratio − 1| = {deviation_text} and the largest mean clip fraction is {clip_text}. "
        "With one optimizer step per freshly sampled batch the policy that computes the loss is the one that "
        "sampled, so r = exp(lp − lp_old) = 1 on every token: importance sampling, PPO and CISPO then all have "
        "the gradient A·∇lp, and with no token clipped PPO and CISPO reduce to importance sampling. "
        "Any difference in this table is seed noise. Make the updates off-policy to compare the losses: "
        "several optimizer steps per batch (`--num-substeps 4`, `--epochs 2`) or stale rollouts "
        "(`--max-steps-off-policy 1`)."
    )


def missing_runs(stats: Sequence[RunStats]) -> list[RunStats]:
    """Runs that did not finish (crashed, killed or failed): the report must say so."""
    return [run for run in stats if not run.finished]


# --- rendering -----------------------------------------------------------------------------


def _number(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _percent(stat: Stat) -> str:
    if stat.mean is None:
        return "–"
    return f"{stat.mean:.2%}" if stat.std is None else f"{stat.mean:.2%} ± {stat.std:.2%}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _runs_table(stats: Sequence[RunStats]) -> list[str]:
    header = ["run", "finished", "steps", "train reward", "test accuracy", "steps/s", "clip fraction", "ratio min", "ratio max"]
    rows = [
        [
            run.name,
            "yes" if run.finished else f"**no** (see `{run.name}/{LOG_FILE}`)",
            str(run.steps),
            _number(run.train_reward),
            _number(run.test_reward),
            _number(run.steps_per_s, 2),
            "–" if run.clip_fraction is None else f"{run.clip_fraction:.2%}",
            _number(run.ratio_min),
            _number(run.ratio_max),
        ]
        for run in stats
    ]
    return _table(header, rows)


def _definitions(last_steps: int) -> str:
    return (
        f"Train reward: mean `reward` of the last {last_steps} logged steps. Test accuracy: `test/reward` of the "
        "final evaluation. `±` is the sample standard deviation over seeds. Clip fractions and ratio mean: "
        "mean over steps of the loss's metrics; ratio min / max: extremes over all steps of all seeds."
    )


def _unfinished_section(stats: Sequence[RunStats]) -> list[str]:
    unfinished = missing_runs(stats)
    if not unfinished:
        return []
    names = ", ".join(f"`{run.name}`" for run in unfinished)
    return [
        "",
        f"**{len(unfinished)} run(s) did not finish: {names}.** Their numbers cover the steps they logged. "
        f"Rerun the same command to resume them (logs in `<run>/{LOG_FILE}` beside this report).",
    ]


def render_compare_report(
    summaries: Sequence[ConfigSummary], *, command: str, last_steps: int, warning: str | None
) -> str:
    """report.md of `grpo compare`: the per-loss table, the per-run table, the warning, the plot."""
    seeds = sorted({run.seed for summary in summaries for run in summary.runs})
    all_runs = [run for summary in summaries for run in summary.runs]
    header = [
        "loss", "runs", "train reward", "test accuracy", "steps/s", "clip fraction",
        "clip low", "clip high", "ratio mean", "ratio min", "ratio max",
    ]
    rows = [
        [
            f"`{summary.label}`",
            f"{summary.finished}/{len(summary.runs)}",
            summary.train_reward.format(),
            summary.test_reward.format(),
            summary.steps_per_s.format(2),
            _percent(summary.clip_fraction),
            _percent(summary.clip_low_fraction),
            _percent(summary.clip_high_fraction),
            summary.ratio_mean.format(4),
            _number(summary.ratio_min),
            _number(summary.ratio_max),
        ]
        for summary in summaries
    ]
    lines = [
        "# Loss comparison",
        "",
        f"{len(summaries)} losses x {len(seeds)} seeds ({', '.join(map(str, seeds))}), made by:",
        "",
        f"    {command}",
        "",
        _definitions(last_steps),
        "",
    ]
    if warning:
        lines += [f"> {warning}", ""]
    lines += _table(header, rows)
    lines += _unfinished_section(all_runs)
    lines += ["", "## Runs", ""] + _runs_table(all_runs)
    lines += ["", "## Reward", "", "![reward per loss: mean over seeds, band = min-max](reward.png)", ""]
    return "\n".join(lines)


def summary_json(summary: ConfigSummary) -> dict[str, Any]:
    """A ConfigSummary as JSON-ready dicts (the report's numbers, unrounded)."""
    data = attrs.asdict(summary, recurse=False, filter=lambda field, _value: field.name != "runs")
    data = {key: attrs.asdict(value) if isinstance(value, Stat) else value for key, value in data.items()}
    data["runs"] = [
        {**attrs.asdict(run), "max_ratio_deviation": run.max_ratio_deviation} for run in summary.runs
    ]
    return data


# --- compare -------------------------------------------------------------------------------


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo compare --loss-fn L... --seeds N [--jobs J] [--out DIR] [train flags]`."""
    parser.add_argument(
        "--loss-fn",
        dest="loss_fns",
        nargs="+",
        default=["importance_sampling", "ppo", "cispo"],
        metavar="LOSS",
        help="losses to compare",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per loss: 0 .. N-1")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="runs in parallel")
    parser.add_argument("--out", default="runs/compare", help="experiment directory")
    parser.add_argument(
        "--last-steps",
        type=int,
        default=DEFAULT_LAST_STEPS,
        help="the final train reward is the mean of this many last steps",
    )
    parser.add_argument("--config", default=None, help="TOML file of train flags for every run (command-line flags win)")
    add_train_flag_arguments(parser, exclude=MANAGED_FLAGS | {"loss_fn"})


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def compare_command(loss_fns: Sequence[str], seeds: int, shared: Mapping[str, Any], out: Path) -> str:
    """The `grpo compare` command line that reproduces an experiment."""
    argv = ["grpo", "compare", "--loss-fn", *loss_fns, "--seeds", str(seeds), *train_argv(shared), "--out", str(out)]
    return shlex.join(argv)


def compare(
    loss_fns: Sequence[str],
    *,
    seeds: int,
    shared: Mapping[str, Any],
    out: Path,
    jobs: int = DEFAULT_JOBS,
    last_steps: int = DEFAULT_LAST_STEPS,
    train_command: Sequence[str] = TRAIN_COMMAND,
    echo: Callable[[str], None] = print,
) -> list[ConfigSummary]:
    """Run every loss x seed (skip finished, resume unfinished), then write report.md, comparison.json, reward.png."""
    # Imported here: the kernels pull in torch, which `grpo plot` and `--help` do not need.
    from grpo.core.losses import get_loss

    _check_positive("--seeds", seeds)
    _check_positive("--last-steps", last_steps)
    if not loss_fns:
        raise ValueError("--loss-fn needs at least one loss")
    duplicates = sorted({name for name in loss_fns if list(loss_fns).count(name) > 1})
    if duplicates:
        raise ValueError(f"--loss-fn lists {duplicates[0]!r} twice; name each loss once")
    for name in loss_fns:
        get_loss(name)
    specs = compare_specs(loss_fns, range(seeds), shared, out)
    execute_runs(specs, jobs=jobs, train_command=train_command, echo=echo)
    runs = [read_run(spec.run_dir) for spec in specs]
    stats = [run_stats(run, label=spec.label, seed=spec.seed, last_steps=last_steps) for run, spec in zip(runs, specs, strict=True)]
    summaries = summarize_by_label(stats)
    warning = on_policy_warning(stats)
    command = compare_command(loss_fns, seeds, shared, out)
    (out / "report.md").write_text(
        render_compare_report(summaries, command=command, last_steps=last_steps, warning=warning)
    )
    (out / "comparison.json").write_text(
        json.dumps(
            {
                "command": command,
                "last_steps": last_steps,
                "warning": warning,
                "losses": [summary_json(summary) for summary in summaries],
            },
            indent=2,
        )
    )
    save_figure(experiment_figure(specs, runs, ["reward", "test/reward"], title=" vs ".join(loss_fns)), out / "reward.png")
    return summaries


def experiment_figure(specs: Sequence[RunSpec], runs: Sequence[RunData], metrics: Sequence[str], *, title: str) -> Figure:
    """Band figure per label: a panel for `metrics[0]`, and for each other metric some run logged."""
    groups: dict[str, list[list[dict[str, Any]]]] = {}
    for spec, run in zip(specs, runs, strict=True):
        groups.setdefault(spec.label, []).append(run.rows)
    logged = set().union(*(metric_keys(run.rows) for run in runs)) if runs else set()
    panels = list(dict.fromkeys([metrics[0], *(metric for metric in metrics[1:] if metric in logged)]))
    return band_figure(groups, panels, title=title)


def run_compare(args: argparse.Namespace, *, train_command: Sequence[str] = TRAIN_COMMAND) -> int:
    """`grpo compare`: 0 when every run finished, 1 when some did not (report still written), 2 on bad input."""
    out = Path(args.out)
    try:
        from_file = normalize_overrides(load_toml(args.config), where=args.config) if args.config else {}
        if "loss_fn" in from_file:
            raise ValueError(f"{args.config}: loss_fn is chosen by compare's --loss-fn; remove it from the file")
        from_cli = normalize_overrides(
            train_flags_from_args(args, exclude=MANAGED_FLAGS | {"loss_fn"}), where="command line"
        )
        summaries = compare(
            args.loss_fns,
            seeds=args.seeds,
            shared={**from_file, **from_cli},
            out=out,
            jobs=args.jobs,
            last_steps=args.last_steps,
            train_command=train_command,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"grpo compare: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {out / 'report.md'}  plot: {out / 'reward.png'}")
    return 0 if all(summary.finished == len(summary.runs) for summary in summaries) else 1


# --- sweep ---------------------------------------------------------------------------------

SWEEP_KEYS = ("base", "grid", "runs", "seeds", "rank_by", "rank_order")
RANK_ORDERS = ("max", "min")


@attrs.frozen
class SweepPlan:
    """A validated sweep file: fixed flags, the configurations (label, overrides), seeds and ranking."""

    path: Path
    base: Mapping[str, Any]
    configs: tuple[tuple[str, Mapping[str, Any]], ...]
    seeds: tuple[int, ...]
    rank_by: str
    rank_order: str


def _format_setting(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return str(value)


def config_label(overrides: Mapping[str, Any]) -> str:
    """`key=value,key=value` of a configuration's own overrides ("base" when it has none)."""
    return ",".join(f"{key}={_format_setting(value)}" for key, value in overrides.items()) or "base"


def load_sweep(path: str | Path) -> SweepPlan:
    """Read and validate a sweep TOML: `[base]`, `[grid]` (lists, cartesian product) or `[[runs]]`,
    optional `seeds = [...]`, `rank_by`, `rank_order` ("max" or "min")."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"sweep file {file} not found")
    with file.open("rb") as handle:
        try:
            raw = tomllib.load(handle)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{file}: not valid TOML ({error})") from None
    for key in raw:
        if key not in SWEEP_KEYS:
            hint = " (train flags go under [base], [grid] or [[runs]])" if key.replace("-", "_") in FIELD_NAMES else ""
            raise ValueError(f"{file}: unknown top-level key {key!r}{hint}; expected {', '.join(SWEEP_KEYS)}")
    base_raw = raw.get("base", {})
    if not isinstance(base_raw, Mapping):
        raise ValueError(f"{file}: [base] must be a table of train flags")
    base = normalize_overrides(base_raw, where=f"{file} [base]")
    configs = _sweep_configs(file, raw)
    labels = [label for label, _ in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{file}: two configurations are the same ({repeated[0]}); give each run different overrides")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(seed, int) and not isinstance(seed, bool) for seed in seeds):
        raise ValueError(f"{file}: seeds must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{file}: seeds lists a seed twice: {seeds!r}")
    rank_by = raw.get("rank_by", "test/reward")
    rank_order = raw.get("rank_order", "max")
    if not isinstance(rank_by, str) or not rank_by:
        raise ValueError(f"{file}: rank_by must be a metric name such as \"test/reward\", got {rank_by!r}")
    if rank_order not in RANK_ORDERS:
        raise ValueError(f"{file}: rank_order must be \"max\" or \"min\", got {rank_order!r}")
    return SweepPlan(path=file, base=base, configs=tuple(configs), seeds=tuple(seeds), rank_by=rank_by, rank_order=rank_order)


def _sweep_configs(file: Path, raw: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (label, overrides) of each configuration of a sweep file's [grid] or [[runs]]."""
    if "grid" in raw and "runs" in raw:
        raise ValueError(f"{file}: has both [grid] and [[runs]]; use one of them")
    if "grid" in raw:
        grid = raw["grid"]
        if not isinstance(grid, Mapping) or not grid:
            raise ValueError(f"{file}: [grid] is empty; give at least one flag with a list of values, e.g. learning_rate = [1e-4, 3e-4]")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"{file}: [grid] {key} must be a non-empty list of values, got {values!r}")
        names = list(grid)
        configs = []
        for combination in itertools.product(*(grid[name] for name in names)):
            overrides = normalize_overrides(dict(zip(names, combination, strict=True)), where=f"{file} [grid]")
            configs.append((config_label(overrides), overrides))
        return configs
    if "runs" in raw:
        runs = raw["runs"]
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{file}: [[runs]] is empty; add at least one [[runs]] table of overrides")
        configs = []
        for index, table in enumerate(runs):
            if not isinstance(table, Mapping):
                raise ValueError(f"{file}: runs[{index}] must be a table of train flags, got {table!r}")
            overrides = dict(table)
            name = overrides.pop("name", None)
            overrides = normalize_overrides(overrides, where=f"{file} runs[{index}]")
            configs.append((str(name) if name is not None else config_label(overrides), overrides))
        return configs
    raise ValueError(f"{file}: no configurations: add a [grid] table of value lists or [[runs]] tables of overrides")


def sweep_specs(plan: SweepPlan, out: Path) -> list[RunSpec]:
    """One run per configuration x seed in `out/<label>-seed<k>`, flags = base | configuration | seed."""
    return [
        RunSpec(label=label, seed=seed, run_dir=out / run_dir_name(label, seed), overrides={**plan.base, **overrides, "seed": seed})
        for label, overrides in plan.configs
        for seed in plan.seeds
    ]


@attrs.frozen
class RankedConfig:
    """A sweep configuration with its ranking metric over seeds; rank 0 when the metric is missing."""

    rank: int
    summary: ConfigSummary
    overrides: Mapping[str, Any]
    metric: Stat


def rank_configs(
    summaries: Sequence[ConfigSummary],
    overrides_by_label: Mapping[str, Mapping[str, Any]],
    metric_by_label: Mapping[str, Stat],
    *,
    order: str,
) -> list[RankedConfig]:
    """Configurations sorted by their mean metric (best first; "max" = higher is better), missing last."""
    sign = -1.0 if order == "max" else 1.0
    present = sorted(
        (summary for summary in summaries if metric_by_label[summary.label].mean is not None),
        key=lambda summary: sign * metric_by_label[summary.label].mean,
    )
    missing = [summary for summary in summaries if metric_by_label[summary.label].mean is None]
    ranked = [
        RankedConfig(rank=rank, summary=summary, overrides=overrides_by_label[summary.label], metric=metric_by_label[summary.label])
        for rank, summary in enumerate(present, start=1)
    ]
    return ranked + [
        RankedConfig(rank=0, summary=summary, overrides=overrides_by_label[summary.label], metric=metric_by_label[summary.label])
        for summary in missing
    ]


def render_sweep_report(
    plan: SweepPlan, ranked: Sequence[RankedConfig], *, command: str, last_steps: int, warnings: Sequence[str]
) -> str:
    """report.md of `grpo sweep`: configurations ranked by the chosen metric, then every run."""
    best = "highest" if plan.rank_order == "max" else "lowest"
    header = ["rank", "configuration", f"{plan.rank_by} (ranked)", "runs", "train reward", "test accuracy", "steps/s", "clip fraction"]
    rows = [
        [
            str(entry.rank) if entry.rank else "–",
            f"`{entry.summary.label}`",
            entry.metric.format(4),
            f"{entry.summary.finished}/{len(entry.summary.runs)}",
            entry.summary.train_reward.format(),
            entry.summary.test_reward.format(),
            entry.summary.steps_per_s.format(2),
            _percent(entry.summary.clip_fraction),
        ]
        for entry in ranked
    ]
    base = shlex.join(train_argv(plan.base)) or "(train defaults)"
    lines = [
        f"# Sweep: {plan.path.name}",
        "",
        f"{len(ranked)} configurations x {len(plan.seeds)} seeds ({', '.join(map(str, plan.seeds))}), "
        f"ranked by the mean over seeds of `{plan.rank_by}` ({best} first). Made by:",
        "",
        f"    {command}",
        "",
        f"Fixed flags: `{base}`.",
        "",
        _definitions(last_steps) + f" `{plan.rank_by}` per run: " + (
            "its final evaluation." if plan.rank_by.startswith("test/") else f"mean of its last {last_steps} logged values."
        ),
        "",
    ]
    lines += [f"> {warning}\n" for warning in warnings]
    lines += _table(header, rows)
    all_runs = [run for entry in ranked for run in entry.summary.runs]
    lines += _unfinished_section(all_runs)
    lines += ["", "## Runs", ""] + _runs_table(all_runs)
    lines += ["", "## Curves", "", "![curves per configuration: mean over seeds, band = min-max](curves.png)", ""]
    return "\n".join(lines)


def sweep(
    plan: SweepPlan,
    *,
    out: Path,
    jobs: int = DEFAULT_JOBS,
    last_steps: int = DEFAULT_LAST_STEPS,
    train_command: Sequence[str] = TRAIN_COMMAND,
    echo: Callable[[str], None] = print,
) -> list[RankedConfig]:
    """Run every configuration x seed (skip finished, resume unfinished), then write report.md, sweep.json, curves.png."""
    _check_positive("--last-steps", last_steps)
    specs = sweep_specs(plan, out)
    execute_runs(specs, jobs=jobs, train_command=train_command, echo=echo)
    runs = [read_run(spec.run_dir) for spec in specs]
    stats = [run_stats(run, label=spec.label, seed=spec.seed, last_steps=last_steps) for run, spec in zip(runs, specs, strict=True)]
    metric_by_label = {
        label: mean_std(final_value(run, plan.rank_by, last_steps) for run, spec in zip(runs, specs, strict=True) if spec.label == label)
        for label, _ in plan.configs
    }
    ranked = rank_configs(summarize_by_label(stats), dict(plan.configs), metric_by_label, order=plan.rank_order)
    warnings = []
    if all(stat.mean is None for stat in metric_by_label.values()):
        logged = sorted(set().union(*(metric_keys(run.rows) for run in runs)))
        warnings.append(
            f"**WARNING: no run logged `{plan.rank_by}`, so nothing is ranked.** "
            f"Rank by a logged metric with `--rank-by` (logged: {', '.join(logged) or 'none'})."
        )
    policy_warning = on_policy_warning(stats)
    if policy_warning and len({run.loss_fn for run in stats}) > 1:
        warnings.append(policy_warning)
    order = ["--rank-order", plan.rank_order] if plan.rank_order != "max" else []
    command = shlex.join(["grpo", "sweep", str(plan.path), "--out", str(out), "--rank-by", plan.rank_by, *order])
    (out / "report.md").write_text(
        render_sweep_report(plan, ranked, command=command, last_steps=last_steps, warnings=warnings)
    )
    (out / "sweep.json").write_text(
        json.dumps(
            {
                "command": command,
                "rank_by": plan.rank_by,
                "rank_order": plan.rank_order,
                "last_steps": last_steps,
                "warnings": warnings,
                "configurations": [
                    {"rank": entry.rank, "overrides": dict(entry.overrides), "metric": attrs.asdict(entry.metric), **summary_json(entry.summary)}
                    for entry in ranked
                ],
            },
            indent=2,
        )
    )
    figure = experiment_figure(specs, runs, ["reward", plan.rank_by, "test/reward"], title=f"sweep {plan.path.name}")
    save_figure(figure, out / "curves.png")
    return ranked


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo sweep SWEEP.toml [--jobs J] [--out DIR] [--rank-by METRIC]`."""
    parser.add_argument("sweep_file", metavar="SWEEP.toml", help="[base] flags, [grid] lists or [[runs]] overrides, seeds, rank_by")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="runs in parallel")
    parser.add_argument("--out", default=None, help="experiment directory (None: runs/sweep-<file name>)")
    parser.add_argument("--rank-by", default=None, metavar="METRIC", help="metric that ranks configurations (None: the file's rank_by, else test/reward)")
    parser.add_argument("--rank-order", choices=RANK_ORDERS, default=None, help="max: higher is better, min: lower is better (None: the file's rank_order, else max)")
    parser.add_argument(
        "--last-steps",
        type=int,
        default=DEFAULT_LAST_STEPS,
        help="per-step metrics are averaged over this many last steps",
    )


def run_sweep(args: argparse.Namespace, *, train_command: Sequence[str] = TRAIN_COMMAND) -> int:
    """`grpo sweep`: 0 when every run finished and ranked, 1 when some did not (report still written), 2 on bad input."""
    try:
        plan = load_sweep(args.sweep_file)
        plan = attrs.evolve(plan, rank_by=args.rank_by or plan.rank_by, rank_order=args.rank_order or plan.rank_order)
        out = Path(args.out) if args.out else Path("runs") / f"sweep-{plan.path.stem}"
        ranked = sweep(plan, out=out, jobs=args.jobs, last_steps=args.last_steps, train_command=train_command)
    except (FileNotFoundError, ValueError) as error:
        print(f"grpo sweep: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {out / 'report.md'}  plot: {out / 'curves.png'}")
    if ranked and ranked[0].rank:
        print(f"best: {ranked[0].summary.label} ({plan.rank_by} {ranked[0].metric.format(4)})")
    complete = all(entry.summary.finished == len(entry.summary.runs) for entry in ranked)
    return 0 if complete and all(entry.rank for entry in ranked) else 1
