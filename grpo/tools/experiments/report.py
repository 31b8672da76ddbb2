"""Reports of experiments: markdown tables, JSON with the same numbers, band plots, and
`run_and_report`, the tail `grpo compare` and `grpo sweep` share (validate every run, run
them, read them, write report.md, the JSON file and the figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo.tools.experiments.runner import (
    DEFAULT_JOBS,
    TRAIN_COMMAND,
    RunSpec,
    check_run_dirs,
    execute_runs,
    planned_configs,
)
from grpo.tools.experiments.stats import (
    ConfigSummary,
    RunData,
    RunStats,
    Stat,
    missing_runs,
    read_run,
    run_stats,
)
from grpo.tools.plots import band_figure, metric_keys, save_figure
from grpo.training.run import run_files
from grpo.training.run.inputs import ReadPath

LARGE_PLAN = 200

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from grpo.training.settings.config import TrainConfig

DEFAULT_LAST_STEPS = 5
REPORT_FILE = "report.md"


def check_positive(name: str, value: int) -> None:
    """ValueError unless the count `value` of option `name` is >= 1."""
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def number(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def percent(stat: Stat) -> str:
    if stat.mean is None:
        return "–"
    return f"{stat.mean:.2%}" if stat.std is None else f"{stat.mean:.2%} ± {stat.std:.2%}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def runs_table(stats: Sequence[RunStats]) -> list[str]:
    header = [
        "run",
        "finished",
        "steps",
        "train reward",
        "test accuracy",
        "steps/s",
        "clip fraction",
        "ratio min",
        "ratio max",
        "tokens",
        "cost",
    ]
    rows = [
        [
            run.name,
            "yes" if run.finished else f"**no** (see `{run.name}/{run_files.LOG_FILE}`)",
            str(run.steps),
            number(run.train_reward),
            number(run.test_reward),
            number(run.steps_per_s, 2),
            "–" if run.clip_fraction is None else f"{run.clip_fraction:.2%}",
            number(run.ratio_min),
            number(run.ratio_max),
            "–" if run.tokens is None else f"{run.tokens:,.0f}",
            "–" if run.cost is None else f"{run.cost:.4f} {run.currency or ''}".rstrip(),
        ]
        for run in stats
    ]
    return table(header, rows)


def definitions(last_steps: int) -> str:
    return (
        f"Train reward: mean `reward` of the last {last_steps} logged steps. Test accuracy: "
        "`test/reward` of the final evaluation. `±` is the sample standard deviation over seeds; "
        "`mean [low, high]` is the mean over seeds with its 95% t interval "
        '(docs/FORMULAS.md, "Evaluation metrics"). '
        "Clip fractions and ratio mean: mean over steps of the loss's metrics; ratio min / max: "
        "extremes over all steps of all seeds."
    )


def report_ending(
    verdict: str | None, runs: Sequence[RunStats], *, heading: str, figure: str, caption: str
) -> list[str]:
    """The lines every experiment report ends with: the verdict (if any), the unfinished runs,
    the table of every run, then the figure `figure` under `heading` with its `caption`."""
    lines = ["", verdict] if verdict else []
    lines += unfinished_section(runs)
    lines += ["", "## Runs", ""] + runs_table(runs)
    return lines + ["", f"## {heading}", "", f"![{caption}]({figure})", ""]


def unfinished_section(stats: Sequence[RunStats]) -> list[str]:
    unfinished = missing_runs(stats)
    if not unfinished:
        return []
    names = ", ".join(f"`{run.name}`" for run in unfinished)
    return [
        "",
        f"**{len(unfinished)} run(s) did not finish: {names}.** Their numbers cover the steps "
        "they logged. Rerun the same command to resume them (logs in "
        f"`<run>/{run_files.LOG_FILE}` beside this report).",
    ]


def summary_json(summary: ConfigSummary) -> dict[str, Any]:
    """A ConfigSummary as JSON-ready dicts (the report's numbers, unrounded)."""
    data = attrs.asdict(summary, recurse=False, filter=lambda field, _value: field.name != "runs")
    data = {
        key: attrs.asdict(value) if isinstance(value, Stat) else value
        for key, value in data.items()
    }
    data["runs"] = [
        {**attrs.asdict(run), "max_ratio_deviation": run.max_ratio_deviation}
        for run in summary.runs
    ]
    return data


def experiment_figure(
    specs: Sequence[RunSpec], runs: Sequence[RunData], metrics: Sequence[str], *, title: str
) -> Figure:
    """Band figure per label: a panel for `metrics[0]`, and for each other metric a run logged."""
    groups: dict[str, list[list[dict[str, Any]]]] = {}
    for spec, run in zip(specs, runs, strict=True):
        groups.setdefault(spec.label, []).append(run.rows)
    logged = set().union(*(metric_keys(run.rows) for run in runs)) if runs else set()
    panels = list(
        dict.fromkeys([metrics[0], *(metric for metric in metrics[1:] if metric in logged)])
    )
    return band_figure(groups, panels, title=title)


@attrs.frozen
class Experiment:
    """The runs of an experiment after execution: spec, what its directory holds, its numbers."""

    specs: Sequence[RunSpec]
    runs: Sequence[RunData]
    stats: Sequence[RunStats]


@attrs.frozen
class Report:
    """What an experiment writes: report.md text, the JSON payload and figure, and its result."""

    markdown: str
    payload: dict[str, Any]
    figure: Figure
    result: Any


def add_experiment_arguments(parser: argparse.ArgumentParser, *, last_steps_help: str) -> None:
    """`--jobs`, `--last-steps` and `--dry-run`, shared by `grpo compare` and `grpo sweep`."""
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="runs in parallel")
    parser.add_argument("--last-steps", type=int, default=DEFAULT_LAST_STEPS, help=last_steps_help)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every run and print the planned tokens (and cost) of the whole plan; "
        "start nothing",
    )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def warn_if_large(specs: Sequence[RunSpec], *, what: str, warn: Callable[[str], None]) -> None:
    """A warning before planning more than LARGE_PLAN runs (each is checked before any starts)."""
    if len(specs) > LARGE_PLAN:
        warn(
            f"warning: {what} of {len(specs)} runs (more than {LARGE_PLAN}): every run is "
            "checked first; progress follows on stderr. Narrow the grid or the seeds if that "
            "is not meant"
        )


def check_experiment(
    specs: Sequence[RunSpec],
    *,
    out: Path | None,
    reads: Sequence[ReadPath],
    jobs: int,
    last_steps: int,
) -> list[TrainConfig]:
    """Every check an experiment makes before it starts anything, and every run's TrainConfig.

    --jobs and --last-steps, distinct run directories that, where they exist, hold runs of
    the same settings (`check_run_dirs`), and each run's config and inputs
    (`planned_configs`). The real run and --dry-run both call this, so a dry run that
    passes is never refused by the real one for a reason it could have known.
    """
    check_positive("--jobs", jobs)
    check_positive("--last-steps", last_steps)
    check_run_dirs(specs)
    return planned_configs(specs, out=out, reads=reads)


def dry_run_specs(
    specs: Sequence[RunSpec],
    *,
    out: Path | None = None,
    reads: Sequence[ReadPath] = (),
    jobs: int = DEFAULT_JOBS,
    last_steps: int = DEFAULT_LAST_STEPS,
    echo: Callable[[str], None] = print,
    progress: Callable[[str], None] = _stderr,
) -> None:
    """`--dry-run`: the real run's checks (`check_experiment`), then every planned run's
    pre-flight and planned tokens (and cost), and the totals.

    One service client per backend serves every run's checks; nothing is written or started.
    Past LARGE_PLAN runs a warning comes first; progress goes to `progress` (stderr), every
    run's check counted, one line per tenth of the plan.
    """
    from grpo.backends.pytrio import make_service_client
    from grpo.training.recipes.grpo.plan import plan_experiment

    warn_if_large(specs, what="a dry run", warn=progress)
    services: dict[str, Any] = {}
    checked = [0]
    every = max(1, len(specs) // 10)

    def service(config: TrainConfig) -> Any:
        # Called once at the start of every run's pre-flight: the progress count.
        checked[0] += 1
        if checked[0] == 1 or checked[0] % every == 0 or checked[0] == len(specs):
            progress(f"checking run {checked[0]}/{len(specs)}: {Path(str(config.run_dir)).name}")
        if config.backend not in services:
            services[config.backend] = make_service_client(config.backend, seed=config.seed)
        return services[config.backend]

    try:
        configs = check_experiment(specs, out=out, reads=reads, jobs=jobs, last_steps=last_steps)
        _planned, lines = plan_experiment(configs, service)
    finally:
        for client in services.values():
            if hasattr(client, "close"):
                client.close()
    for line in lines:
        echo(line)


def run_and_report(
    specs: Sequence[RunSpec],
    *,
    out: Path,
    json_name: str,
    figure_name: str,
    render: Callable[[Experiment], Report],
    jobs: int,
    last_steps: int,
    train_command: Sequence[str] = TRAIN_COMMAND,
    echo: Callable[[str], None] = print,
    reads: Sequence[ReadPath] = (),
) -> Any:
    """Validate every run's config, run what is not finished, then write `render`'s report.

    Nothing starts unless every planned run's TrainConfig builds (ConfigError names the run
    and the flag) and `out` is clear of `reads` and of what every run reads. Returns the
    report's `result`.
    """
    warn_if_large(specs, what="an experiment", warn=_stderr)
    check_experiment(specs, out=out, reads=reads, jobs=jobs, last_steps=last_steps)
    execute_runs(specs, jobs=jobs, train_command=train_command, echo=echo)
    runs = [read_run(spec.run_dir) for spec in specs]
    stats = [
        run_stats(run, label=spec.label, seed=spec.seed, last_steps=last_steps)
        for run, spec in zip(runs, specs, strict=True)
    ]
    report = render(Experiment(specs=specs, runs=runs, stats=stats))
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(report.markdown)
    (out / json_name).write_text(json.dumps(report.payload, indent=2))
    save_figure(report.figure, out / figure_name)
    return report.result
