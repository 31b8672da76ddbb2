"""`grpo sweep`: a grid or list of flag overrides from a TOML file, x seeds, ranked by a metric;
report.md, sweep.json and curves.png in the experiment directory.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo.tools.experiments.report import (
    DEFAULT_LAST_STEPS,
    REPORT_FILE,
    Experiment,
    Report,
    add_experiment_arguments,
    check_positive,
    definitions,
    dry_run_specs,
    experiment_figure,
    percent,
    report_ending,
    run_and_report,
    summary_json,
    table,
)
from grpo.tools.experiments.runner import (
    DEFAULT_JOBS,
    TRAIN_COMMAND,
    RunSpec,
    normalize_overrides,
    run_dir_name,
)
from grpo.tools.experiments.stats import (
    ConfigSummary,
    Stat,
    final_value,
    mean_std,
    on_policy_warning,
    separation,
    summarize_by_label,
)
from grpo.tools.plots import metric_keys
from grpo.training.run.inputs import read_paths
from grpo.training.settings.config import FIELD_NAMES
from grpo.training.settings.flags import read_toml, train_argv

SWEEP_FILE = "sweep.json"
FIGURE_FILE = "curves.png"
SWEEP_KEYS = ("base", "grid", "runs", "seeds", "rank_by", "rank_order")
RANK_ORDERS = ("max", "min")
DEFAULT_MAX_RUNS = 1000
"""The most runs (configurations x seeds) a sweep plans without --max-runs: every run is
checked before any starts, and each then trains."""


@attrs.frozen
class ExperimentPlan:
    """Configurations (label, overrides) x seeds over fixed `base` flags: one run each.

    `grpo compare` is the plan of a one-axis grid over `loss_fn` (see `compare.compare_plan`).
    """

    base: Mapping[str, Any]
    configs: tuple[tuple[str, Mapping[str, Any]], ...]
    seeds: tuple[int, ...]


@attrs.frozen
class SweepPlan(ExperimentPlan):
    """A validated sweep file: its plan, the file it came from, and how it ranks."""

    path: Path
    rank_by: str
    rank_order: str
    shape: tuple[int, ...] = ()
    """The number of values of each [grid] key (empty for [[runs]])."""

    def size(self) -> str:
        """The plan's size, e.g. "100 x 100 = 10,000 configurations x 1 seed(s) = 10,000 runs"."""
        return plan_size(self.shape, len(self.configs), len(self.seeds))


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


def grid_configs(
    grid: Mapping[str, Sequence[Any]],
    *,
    where: str,
    label: Callable[[Mapping[str, Any]], str] = config_label,
    check: Callable[[dict[str, Any]], dict[str, Any]] = dict,
) -> list[tuple[str, dict[str, Any]]]:
    """The (label, overrides) of every combination of `grid`'s value lists (cartesian product,
    first key slowest); `check` normalizes each combination's overrides."""
    for key, values in grid.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"{where} {key} must be a non-empty list of values, got {values!r}")
    names = list(grid)
    configs = []
    for combination in itertools.product(*(grid[name] for name in names)):
        overrides = check(dict(zip(names, combination, strict=True)))
        configs.append((label(overrides), overrides))
    return configs


def check_distinct(configs: Sequence[tuple[str, Mapping[str, Any]]], *, where: str) -> None:
    """ValueError unless every configuration has its own label (its runs' directories)."""
    labels = [label for label, _ in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"{where}: two configurations are the same ({repeated[0]}); "
            "give each run different overrides"
        )


def plan_size(shape: Sequence[int], configs: int, seeds: int) -> str:
    """The size of a plan in words: its grid's axes (if any), configurations, seeds, runs."""
    axes = f"{' x '.join(map(str, shape))} = " if len(shape) > 1 else ""
    return f"{axes}{configs:,} configurations x {seeds} seed(s) = {configs * seeds:,} runs"


def _grid_shape(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """The number of values of each [grid] key (empty when any is not a non-empty list)."""
    grid = raw.get("grid")
    if not isinstance(grid, Mapping) or "runs" in raw:
        return ()
    values = list(grid.values())
    if not values or not all(isinstance(v, (list, tuple)) and v for v in values):
        return ()
    return tuple(len(v) for v in values)


def load_sweep(path: str | Path, *, max_runs: int = DEFAULT_MAX_RUNS) -> SweepPlan:
    """Read and validate a sweep TOML: `[base]`, `[grid]` (lists, cartesian product) or `[[runs]]`,
    optional `seeds = [...]`, `rank_by`, `rank_order` ("max" or "min").

    A plan of more than `max_runs` runs is refused from the lengths of its lists, before any
    configuration is built (ValueError naming its size and --max-runs).
    """
    file = Path(path)
    raw, _text = read_toml(file, what="sweep file")
    for key in raw:
        if key not in SWEEP_KEYS:
            hint = (
                " (train flags go under [base], [grid] or [[runs]])"
                if key.replace("-", "_") in FIELD_NAMES
                else ""
            )
            raise ValueError(
                f"{file}: unknown top-level key {key!r}{hint}; expected {', '.join(SWEEP_KEYS)}"
            )
    base_raw = raw.get("base", {})
    if not isinstance(base_raw, Mapping):
        raise ValueError(f"{file}: [base] must be a table of train flags")
    base = normalize_overrides(base_raw, where=f"{file} [base]")
    seeds = raw.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(seed, int) and not isinstance(seed, bool) for seed in seeds)
    ):
        raise ValueError(f"{file}: seeds must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{file}: seeds lists a seed twice: {seeds!r}")
    shape = _grid_shape(raw)
    runs = raw.get("runs")
    count = math.prod(shape) if shape else len(runs) if isinstance(runs, list) else 0
    if count * len(seeds) > max_runs:
        raise ValueError(
            f"{file}: {plan_size(shape, count, len(seeds))}, more than --max-runs {max_runs:,} "
            "(every run is checked before any starts, then trained); narrow the grid or the "
            f"seeds, or pass --max-runs {count * len(seeds)} if that many runs are meant"
        )
    configs = _sweep_configs(file, raw)
    check_distinct(configs, where=str(file))
    rank_by = raw.get("rank_by", "test/reward")
    rank_order = raw.get("rank_order", "max")
    if not isinstance(rank_by, str) or not rank_by:
        raise ValueError(
            f'{file}: rank_by must be a metric name such as "test/reward", got {rank_by!r}'
        )
    if rank_order not in RANK_ORDERS:
        raise ValueError(f'{file}: rank_order must be "max" or "min", got {rank_order!r}')
    return SweepPlan(
        path=file,
        base=base,
        configs=tuple(configs),
        seeds=tuple(seeds),
        rank_by=rank_by,
        rank_order=rank_order,
        shape=shape,
    )


def _sweep_configs(file: Path, raw: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (label, overrides) of each configuration of a sweep file's [grid] or [[runs]]."""
    if "grid" in raw and "runs" in raw:
        raise ValueError(f"{file}: has both [grid] and [[runs]]; use one of them")
    if "grid" in raw:
        grid = raw["grid"]
        if not isinstance(grid, Mapping) or not grid:
            raise ValueError(
                f"{file}: [grid] is empty; give at least one flag with a list of values, "
                "e.g. learning_rate = [1e-4, 3e-4]"
            )
        return grid_configs(
            grid,
            where=f"{file}: [grid]",
            check=lambda raw: normalize_overrides(raw, where=f"{file} [grid]"),
        )
    if "runs" in raw:
        runs = raw["runs"]
        if not isinstance(runs, list) or not runs:
            raise ValueError(
                f"{file}: [[runs]] is empty; add at least one [[runs]] table of overrides"
            )
        configs = []
        for index, entry in enumerate(runs):
            if not isinstance(entry, Mapping):
                raise ValueError(
                    f"{file}: runs[{index}] must be a table of train flags, got {entry!r}"
                )
            overrides = dict(entry)
            name = overrides.pop("name", None)
            overrides = normalize_overrides(overrides, where=f"{file} runs[{index}]")
            configs.append((str(name) if name is not None else config_label(overrides), overrides))
        return configs
    raise ValueError(
        f"{file}: no configurations: add a [grid] table of value lists "
        "or [[runs]] tables of overrides"
    )


def sweep_specs(plan: ExperimentPlan, out: Path) -> list[RunSpec]:
    """One run per configuration x seed in `out/<label>-seed<k>`: base | configuration | seed,
    each in the trackers' group named after the experiment directory (unless --tracker-group)."""
    group = {"tracker_group": plan.base.get("tracker_group") or out.resolve().name or "grpo"}
    return [
        RunSpec(
            label=label,
            seed=seed,
            run_dir=out / run_dir_name(label, seed),
            overrides={**plan.base, **overrides, **group, "seed": seed},
        )
        for label, overrides in plan.configs
        for seed in plan.seeds
    ]


@attrs.frozen
class RankedConfig:
    """A sweep configuration with its ranking metric over seeds; rank 0 when it is missing."""

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
    """Configurations by mean metric, best first ("max": higher is better), missing ones last."""
    sign = -1.0 if order == "max" else 1.0
    present = sorted(
        (summary for summary in summaries if metric_by_label[summary.label].mean is not None),
        key=lambda summary: sign * metric_by_label[summary.label].mean,
    )
    missing = [summary for summary in summaries if metric_by_label[summary.label].mean is None]
    ranked = [
        RankedConfig(
            rank=rank,
            summary=summary,
            overrides=overrides_by_label[summary.label],
            metric=metric_by_label[summary.label],
        )
        for rank, summary in enumerate(present, start=1)
    ]
    return ranked + [
        RankedConfig(
            rank=0,
            summary=summary,
            overrides=overrides_by_label[summary.label],
            metric=metric_by_label[summary.label],
        )
        for summary in missing
    ]


def render_sweep_report(
    plan: SweepPlan,
    ranked: Sequence[RankedConfig],
    *,
    command: str,
    last_steps: int,
    warnings: Sequence[str],
) -> str:
    """report.md of `grpo sweep`: configurations ranked by the chosen metric, then every run."""
    best = "highest" if plan.rank_order == "max" else "lowest"
    header = [
        "rank",
        "configuration",
        f"{plan.rank_by} (ranked)",
        "runs",
        "train reward",
        "test accuracy",
        "steps/s",
        "clip fraction",
    ]
    rows = [
        [
            str(entry.rank) if entry.rank else "–",
            f"`{entry.summary.label}`",
            entry.metric.format_interval(4),
            f"{entry.summary.finished}/{len(entry.summary.runs)}",
            entry.summary.train_reward.format(),
            entry.summary.test_reward.format_interval(),
            entry.summary.steps_per_s.format(2),
            percent(entry.summary.clip_fraction),
        ]
        for entry in ranked
    ]
    base = shlex.join(train_argv(plan.base)) or "(train defaults)"
    lines = [
        f"# Sweep: {plan.path.name}",
        "",
        f"{len(ranked)} configurations x {len(plan.seeds)} seeds "
        f"({', '.join(map(str, plan.seeds))}), "
        f"ranked by the mean over seeds of `{plan.rank_by}` ({best} first). Made by:",
        "",
        f"    {command}",
        "",
        f"Fixed flags: `{base}`.",
        "",
        definitions(last_steps)
        + f" `{plan.rank_by}` per run: "
        + (
            "its final evaluation."
            if plan.rank_by.startswith("test/")
            else f"mean of its last {last_steps} logged values."
        ),
        "",
    ]
    lines += [f"> {warning}\n" for warning in warnings]
    lines += table(header, rows)
    verdict = separation(
        [(entry.summary.label, entry.metric) for entry in ranked if entry.rank],
        what=f"`{plan.rank_by}`",
        more_seeds="`seeds = [0, 1, 2]` in the sweep file",
    )
    lines += report_ending(
        verdict,
        [run for entry in ranked for run in entry.summary.runs],
        heading="Curves",
        figure=FIGURE_FILE,
        caption="curves per configuration: mean over seeds, band = 95% t interval",
    )
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
    """Run every configuration x seed (skip finished, resume unfinished); write report and plot."""
    order = ["--rank-order", plan.rank_order] if plan.rank_order != "max" else []
    command = shlex.join(
        ["grpo", "sweep", str(plan.path), "--out", str(out), "--rank-by", plan.rank_by, *order]
    )

    def render(experiment: Experiment) -> Report:
        runs, specs = experiment.runs, experiment.specs
        metric_by_label = {
            label: mean_std(
                final_value(run, plan.rank_by, last_steps)
                for run, spec in zip(runs, specs, strict=True)
                if spec.label == label
            )
            for label, _ in plan.configs
        }
        ranked = rank_configs(
            summarize_by_label(experiment.stats),
            dict(plan.configs),
            metric_by_label,
            order=plan.rank_order,
        )
        warnings = []
        if all(stat.mean is None for stat in metric_by_label.values()):
            logged = sorted(set().union(*(metric_keys(run.rows) for run in runs)))
            warnings.append(
                f"**WARNING: no run logged `{plan.rank_by}`, so nothing is ranked.** "
                f"Rank by a logged metric with `--rank-by` (logged: {', '.join(logged) or 'none'})."
            )
        policy_warning = on_policy_warning(experiment.stats)
        if policy_warning and len({run.loss_fn for run in experiment.stats}) > 1:
            warnings.append(policy_warning)
        payload = {
            "command": command,
            "rank_by": plan.rank_by,
            "rank_order": plan.rank_order,
            "last_steps": last_steps,
            "warnings": warnings,
            "configurations": [
                {
                    "rank": entry.rank,
                    "overrides": dict(entry.overrides),
                    "metric": attrs.asdict(entry.metric),
                    **summary_json(entry.summary),
                }
                for entry in ranked
            ],
        }
        figure = experiment_figure(
            specs, runs, ["reward", plan.rank_by, "test/reward"], title=f"sweep {plan.path.name}"
        )
        markdown = render_sweep_report(
            plan, ranked, command=command, last_steps=last_steps, warnings=warnings
        )
        return Report(markdown=markdown, payload=payload, figure=figure, result=ranked)

    return run_and_report(
        sweep_specs(plan, out),
        out=out,
        json_name=SWEEP_FILE,
        figure_name=FIGURE_FILE,
        render=render,
        jobs=jobs,
        last_steps=last_steps,
        train_command=train_command,
        echo=echo,
        reads=read_paths("SWEEP.toml", plan.path),
    )


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo sweep SWEEP.toml [--jobs J] [--out DIR] [--rank-by METRIC]`."""
    parser.add_argument(
        "sweep_file",
        metavar="SWEEP.toml",
        help="[base] flags, [grid] lists or [[runs]] overrides, seeds, rank_by",
    )
    parser.add_argument(
        "--out", default=None, help="experiment directory (None: runs/sweep-<file name>)"
    )
    parser.add_argument(
        "--rank-by",
        default=None,
        metavar="METRIC",
        help="metric that ranks configurations (None: the file's rank_by, else test/reward)",
    )
    parser.add_argument(
        "--rank-order",
        choices=RANK_ORDERS,
        default=None,
        help="max: higher is better, min: lower is better (None: the file's rank_order, else max)",
    )
    parser.add_argument(
        "--max-runs",
        type=int,
        default=DEFAULT_MAX_RUNS,
        metavar="N",
        help="refuse a plan of more than N runs (configurations x seeds), before planning "
        f"any (default {DEFAULT_MAX_RUNS})",
    )
    add_experiment_arguments(
        parser, last_steps_help="per-step metrics are averaged over this many last steps"
    )


def run_sweep(args: argparse.Namespace, *, train_command: Sequence[str] = TRAIN_COMMAND) -> int:
    """`grpo sweep`: 0 if all runs finished and ranked, 1 if not (report written), 2: bad input."""
    try:
        check_positive("--max-runs", args.max_runs)
        plan = load_sweep(args.sweep_file, max_runs=args.max_runs)
        print(f"sweep {plan.path}: {plan.size()}", file=sys.stderr, flush=True)
        plan = attrs.evolve(
            plan,
            rank_by=args.rank_by or plan.rank_by,
            rank_order=args.rank_order or plan.rank_order,
        )
        out = Path(args.out) if args.out else Path("runs") / f"sweep-{plan.path.stem}"
        if args.dry_run:
            dry_run_specs(
                sweep_specs(plan, out),
                out=out,
                reads=read_paths("SWEEP.toml", plan.path),
                jobs=args.jobs,
                last_steps=args.last_steps,
            )
            return 0
        ranked = sweep(
            plan, out=out, jobs=args.jobs, last_steps=args.last_steps, train_command=train_command
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"grpo sweep: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {out / REPORT_FILE}  plot: {out / FIGURE_FILE}")
    if ranked and ranked[0].rank:
        print(f"best: {ranked[0].summary.label} ({plan.rank_by} {ranked[0].metric.format(4)})")
    complete = all(entry.summary.finished == len(entry.summary.runs) for entry in ranked)
    return 0 if complete and all(entry.rank for entry in ranked) else 1
