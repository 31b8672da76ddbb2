"""`grpo compare`: the same run for several losses x seeds, then a report, comparison.json
and reward.png in the experiment directory. Its plan is the sweep plan of a one-axis grid over
`loss_fn` (`sweep.grid_configs`), so runs are planned, named and launched as a sweep's are.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

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
    number,
    percent,
    report_ending,
    run_and_report,
    summary_json,
    table,
)
from grpo.tools.experiments.runner import (
    DEFAULT_JOBS,
    MANAGED_FLAGS,
    TRAIN_COMMAND,
    RunSpec,
    normalize_overrides,
)
from grpo.tools.experiments.stats import (
    ConfigSummary,
    on_policy_warning,
    separation,
    summarize_by_label,
)
from grpo.tools.experiments.sweep import ExperimentPlan, check_distinct, grid_configs, sweep_specs
from grpo.training.run.inputs import ReadPath, read_paths
from grpo.training.settings.flags import add_train_arguments, explicit_flags, load_toml, train_argv

COMPARISON_FILE = "comparison.json"
FIGURE_FILE = "reward.png"


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
    parser.add_argument("--out", default="runs/compare", help="experiment directory")
    parser.add_argument(
        "--config",
        default=None,
        help="TOML file of train flags for every run (command-line flags win)",
    )
    add_experiment_arguments(
        parser, last_steps_help="the final train reward is the mean of this many last steps"
    )
    group = parser.add_argument_group("train flags, passed to every run (see `grpo train --help`)")
    add_train_arguments(group, exclude=MANAGED_FLAGS | {"loss_fn"})


def compare_plan(
    loss_fns: Sequence[str], seeds: Sequence[int], shared: Mapping[str, Any]
) -> ExperimentPlan:
    """The sweep plan of a one-axis grid over `loss_fn`, each configuration labelled by its loss."""
    configs = grid_configs(
        {"loss_fn": list(loss_fns)}, where="--loss-fn", label=lambda overrides: overrides["loss_fn"]
    )
    check_distinct(configs, where="--loss-fn")
    return ExperimentPlan(base=dict(shared), configs=tuple(configs), seeds=tuple(seeds))


def compare_specs(
    loss_fns: Sequence[str], seeds: Sequence[int], shared: Mapping[str, Any], out: Path
) -> list[RunSpec]:
    """One run per loss x seed, in `out/<loss>-seed<k>`, all with the `shared` flags."""
    return sweep_specs(compare_plan(loss_fns, seeds, shared), out)


def compare_command(
    loss_fns: Sequence[str], seeds: int, shared: Mapping[str, Any], out: Path
) -> str:
    """The `grpo compare` command line that reproduces an experiment."""
    argv = [
        "grpo",
        "compare",
        "--loss-fn",
        *loss_fns,
        "--seeds",
        str(seeds),
        *train_argv(shared),
        "--out",
        str(out),
    ]
    return shlex.join(argv)


def render_compare_report(
    summaries: Sequence[ConfigSummary], *, command: str, last_steps: int, warning: str | None
) -> str:
    """report.md of `grpo compare`: the per-loss table, the per-run table, the warning, the plot."""
    seeds = sorted({run.seed for summary in summaries for run in summary.runs})
    all_runs = [run for summary in summaries for run in summary.runs]
    header = [
        "loss",
        "runs",
        "train reward",
        "test accuracy",
        "steps/s",
        "clip fraction",
        "clip low",
        "clip high",
        "ratio mean",
        "ratio min",
        "ratio max",
    ]
    rows = [
        [
            f"`{summary.label}`",
            f"{summary.finished}/{len(summary.runs)}",
            summary.train_reward.format(),
            summary.test_reward.format_interval(),
            summary.steps_per_s.format(2),
            percent(summary.clip_fraction),
            percent(summary.clip_low_fraction),
            percent(summary.clip_high_fraction),
            summary.ratio_mean.format(4),
            number(summary.ratio_min),
            number(summary.ratio_max),
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
        definitions(last_steps),
        "",
    ]
    if warning:
        lines += [f"> {warning}", ""]
    lines += table(header, rows)
    by_test = sorted(
        (summary for summary in summaries if summary.test_reward.mean is not None),
        key=lambda summary: -float(summary.test_reward.mean or 0.0),
    )
    verdict = separation(
        [(summary.label, summary.test_reward) for summary in by_test],
        what="Test accuracy",
        more_seeds="`--seeds 3`",
    )
    lines += report_ending(
        verdict,
        all_runs,
        heading="Reward",
        figure=FIGURE_FILE,
        caption="reward per loss: mean over seeds, band = 95% t interval",
    )
    return "\n".join(lines)


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
    reads: Sequence[ReadPath] = (),
) -> list[ConfigSummary]:
    """Run every loss x seed (skip finished, resume unfinished); write the report, JSON, plot.

    `out` never is, lies inside or holds `reads` (the --config file) or what a run reads."""
    check_positive("--seeds", seeds)
    specs = compare_specs(loss_fns, range(seeds), shared, out)
    command = compare_command(loss_fns, seeds, shared, out)

    def render(experiment: Experiment) -> Report:
        summaries = summarize_by_label(experiment.stats)
        warning = on_policy_warning(experiment.stats)
        payload = {
            "command": command,
            "last_steps": last_steps,
            "warning": warning,
            "losses": [summary_json(summary) for summary in summaries],
        }
        figure = experiment_figure(
            experiment.specs,
            experiment.runs,
            ["reward", "test/reward"],
            title=" vs ".join(loss_fns),
        )
        markdown = render_compare_report(
            summaries, command=command, last_steps=last_steps, warning=warning
        )
        return Report(markdown=markdown, payload=payload, figure=figure, result=summaries)

    return run_and_report(
        specs,
        out=out,
        json_name=COMPARISON_FILE,
        figure_name=FIGURE_FILE,
        render=render,
        jobs=jobs,
        last_steps=last_steps,
        train_command=train_command,
        echo=echo,
        reads=reads,
    )


def run_compare(args: argparse.Namespace, *, train_command: Sequence[str] = TRAIN_COMMAND) -> int:
    """`grpo compare`: exit 0 if every run finished, 1 if not (report written), 2: bad input."""
    out = Path(args.out)
    try:
        from_file = (
            normalize_overrides(load_toml(args.config), where=args.config) if args.config else {}
        )
        if "loss_fn" in from_file:
            raise ValueError(
                f"{args.config}: loss_fn is chosen by compare's --loss-fn; remove it from the file"
            )
        from_cli = normalize_overrides(
            explicit_flags(args, exclude=MANAGED_FLAGS | {"loss_fn"}), where="command line"
        )
        reads = read_paths("--config", args.config)
        if args.dry_run:
            shared = {**from_file, **from_cli}
            specs = compare_specs(args.loss_fns, range(args.seeds), shared, out)
            dry_run_specs(specs, out=out, reads=reads, jobs=args.jobs, last_steps=args.last_steps)
            return 0
        summaries = compare(
            args.loss_fns,
            seeds=args.seeds,
            shared={**from_file, **from_cli},
            out=out,
            jobs=args.jobs,
            last_steps=args.last_steps,
            train_command=train_command,
            reads=reads,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"grpo compare: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {out / REPORT_FILE}  plot: {out / FIGURE_FILE}")
    return 0 if all(summary.finished == len(summary.runs) for summary in summaries) else 1
