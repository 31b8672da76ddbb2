"""Plots from run directories, and the picture of how the loss kernels differ.

- `grpo plot RUN_DIR...`: a subplot per metric, one line per run, read from `metrics.jsonl`
  (no tracker account needed), or from a TensorBoard log directory (another trainer's run).
- Band plots for `grpo compare` / `grpo sweep`: per configuration, the mean over seeds with a
  min–max band.
- `grpo plot-losses`: each kernel's per-token objective o and gradient weight do/dlp against
  the ratio r = exp(lp − lp_old), for A > 0 and A < 0, computed by running the real kernels
  of `grpo.core.losses` under autograd (the figure *is* the kernels, not a re-derivation).

Reading and shaping data (`read_run_metrics`, `metric_series`, `mean_band`,
`loss_shape_curves`) are pure functions; the `*_figure` functions build a matplotlib
`Figure` without pyplot (Agg canvas, no display, no global state) and `save_figure` writes it.
An explicit `--out` is checked by `grpo.tools.paths.check_out` (not an existing file, not in
a run or checkpoint directory, unless `--force`); the defaults are these tools' own files.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from grpo.core.evaluation import t_interval
from grpo.tools import paths
from grpo.training.run import run_files
from grpo.training.run.inputs import read_paths
from grpo.training.run.run_files import STEP_KEY

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Default panels of `grpo plot`, kept when some run logged them. "clip_fraction" has no exact
# key: it matches each run's `<loss_fn>/clip_fraction` (see `resolve_metric_keys`).
DEFAULT_PLOT_METRICS: tuple[str, ...] = (
    "reward",
    "frac_degenerate",
    "rollout/avg_gen_len",
    "clip_fraction",
    "kl",
    "loss",
    "test/reward",
)

# Metrics logged only on some steps (evaluations) are drawn with markers so lone points show.
_SPARSE_PREFIX = "test/"
LOSS_SHAPES_PNG = "docs/loss_shapes.png"
"""The figure of docs/FORMULAS.md that `grpo plot-losses` regenerates by default."""

MetricRows = list[dict[str, Any]]

# Curves of a panel can coincide (importance_sampling and cispo are one curve while no ratio
# is clipped): each gets its own line style and marker, and each later one is drawn thinner
# on top, so the curves under it still show at its edges.
SERIES_LINE_STYLES = ("-", "--", "-.", ":")
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SERIES_WIDEST, SERIES_THINNEST, SERIES_WIDTH_STEP = 3.0, 1.0, 0.6
SERIES_MARKS_PER_CURVE = 10


# --- reading -------------------------------------------------------------------------------


def read_run_metrics(run_dir: str | Path) -> MetricRows:
    """The merged per-step metrics of a run directory (`run_dir.merge_rows_by_step` of its
    rows); without a metrics.jsonl, the scalars of the TensorBoard event files at or under it
    (another trainer's run: `grpo.tools.tensorboard_events`)."""
    directory = Path(run_dir)
    if not (directory / run_files.METRICS_FILE).is_file():
        from grpo.tools.tensorboard_events import event_directory, read_event_rows

        events = event_directory(directory) if directory.is_dir() else None
        if events is not None:
            return read_event_rows(events)
        raise FileNotFoundError(
            f"{directory / run_files.METRICS_FILE} not found, nor TensorBoard event files: "
            f"is {run_dir} a `grpo train` run directory (or a TensorBoard log directory)?"
        )
    return run_files.merge_rows_by_step(run_files.read_metrics(directory))


def metric_keys(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """Every metric key logged in `rows` (all keys but the step)."""
    return {key for row in rows for key in row if key != STEP_KEY}


def resolve_metric_keys(metric: str, keys: set[str], *, exact_somewhere: bool) -> list[str]:
    """The keys of one run that plot as `metric`: the exact key, else every `<prefix>/<metric>`.

    The suffix form lets "clip_fraction" mean `ppo/clip_fraction` in a PPO run and
    `cispo/clip_fraction` in a CISPO run. It is used only when no run has the exact key
    (`exact_somewhere` false), so "reward" never picks up "test/reward".
    """
    if metric in keys:
        return [metric]
    if exact_somewhere:
        return []
    return sorted(key for key in keys if "/" in key and key.split("/", 1)[1] == metric)


def suffix_aliases(keys: set[str]) -> set[str]:
    """Names that `resolve_metric_keys` accepts by suffix: the part after the first '/'."""
    return {key.split("/", 1)[1] for key in keys if "/" in key} - keys


def metric_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that logged `key`, as float arrays in step order."""
    pairs = [(row[STEP_KEY], row[key]) for row in rows if row.get(key) is not None]
    if not pairs:
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs, strict=True)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


@attrs.frozen
class Band:
    """A curve over seeds: at each step, the mean, min and max of the seeds that logged it, and
    the 95% t interval of the mean (`ci_low`, `ci_high`; NaN where fewer than 2 seeds logged)."""

    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    count: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray


def mean_band(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> Band:
    """Mean, min and max across runs at each step of the union of their steps."""
    all_steps = np.unique(np.concatenate([steps for steps, _ in series])) if series else np.empty(0)
    table = np.full((len(series), all_steps.size), np.nan)
    for row, (steps, values) in enumerate(series):
        table[row, np.searchsorted(all_steps, steps)] = values
    present = ~np.isnan(table)
    count = present.sum(axis=0)
    filled_sum = np.where(present, table, 0.0).sum(axis=0)
    intervals = [t_interval(column[~np.isnan(column)]) for column in table.T]
    return Band(
        steps=all_steps,
        mean=filled_sum / np.maximum(count, 1),
        low=np.where(present, table, np.inf).min(axis=0, initial=np.inf),
        high=np.where(present, table, -np.inf).max(axis=0, initial=-np.inf),
        count=count,
        ci_low=np.array([np.nan if i is None else i.low for i in intervals]),
        ci_high=np.array([np.nan if i is None else i.high for i in intervals]),
    )


# --- figures -------------------------------------------------------------------------------


def series_style(index: int, points: int, *, sparse: bool) -> dict[str, Any]:
    """`Axes.plot` keywords of a panel's curve ``index`` over ``points`` steps: its own line
    style and marker, narrower with smaller marks than every earlier curve (down to a floor);
    a dense curve is marked at about SERIES_MARKS_PER_CURVE steps, offset per curve."""
    every = max(1, points // SERIES_MARKS_PER_CURVE)
    width = max(SERIES_THINNEST, SERIES_WIDEST - SERIES_WIDTH_STEP * index)
    return {
        "linestyle": SERIES_LINE_STYLES[index % len(SERIES_LINE_STYLES)],
        "marker": SERIES_MARKERS[index % len(SERIES_MARKERS)],
        "linewidth": width,
        "markersize": 1.0 + 2.0 * width,  # marks on the same point nest, the earlier larger
        "markevery": None if sparse else (index % every, every),
    }


def _grid_figure(
    panel_count: int, *, columns: int, panel_size: tuple[float, float]
) -> tuple[Figure, list[Any]]:
    """A Figure on an Agg canvas with `panel_count` axes in a grid (extra cells removed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    columns = max(1, min(columns, panel_count))
    rows = math.ceil(panel_count / columns)
    figure = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(rows, columns, index + 1) for index in range(panel_count)]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure, axes


def save_figure(figure: Figure, path: str | Path) -> Path:
    """Write `figure` as a PNG at `path` (parent folders created) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out


def metrics_figure(runs: Mapping[str, MetricRows], metrics: Sequence[str]) -> Figure:
    """A subplot per metric, one line per run (and per matching key) against the step.

    Raises ValueError naming the available metrics when a metric matches no run.
    """
    if not runs:
        raise ValueError("no runs to plot")
    keys_by_run = {label: metric_keys(rows) for label, rows in runs.items()}
    all_keys = set().union(*keys_by_run.values())
    figure, axes = _grid_figure(
        len(metrics), columns=3 if len(metrics) > 4 else 2, panel_size=(5.0, 3.4)
    )
    for ax, metric in zip(axes, metrics, strict=True):
        drawn = 0
        for label, rows in runs.items():
            keys = resolve_metric_keys(
                metric, keys_by_run[label], exact_somewhere=metric in all_keys
            )
            for key in keys:
                steps, values = metric_series(rows, key)
                line_label = label if len(keys) == 1 else f"{label} ({key})"
                sparse = key.startswith(_SPARSE_PREFIX)
                style = series_style(drawn, steps.size, sparse=sparse)
                ax.plot(steps, values, label=line_label, **style)
                drawn += 1
        if drawn == 0:
            raise ValueError(unknown_metric_message(metric, all_keys))
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return figure


def unknown_metric_message(metric: str, keys: set[str]) -> str:
    """The error for a metric no run logged, listing what can be plotted."""
    aliases = sorted(suffix_aliases(keys))
    available = ", ".join(sorted(keys)) or f"none (empty {run_files.METRICS_FILE})"
    by_suffix = f"; by suffix: {', '.join(aliases)}" if aliases else ""
    return f"unknown metric {metric!r}: no run logged it. Available: {available}{by_suffix}"


def band_figure(
    groups: Mapping[str, Sequence[MetricRows]], metrics: Sequence[str], *, title: str = ""
) -> Figure:
    """A subplot per metric; per group, the mean over its runs with its shaded 95% t interval
    over the runs at each step (docs/FORMULAS.md, "Evaluation metrics"; none for one run).

    `ax.lines[i]` of each panel is group i's mean curve (groups without the metric draw an
    empty line, so the index always matches the group order).
    """
    figure, axes = _grid_figure(len(metrics), columns=2, panel_size=(6.0, 4.0))
    for ax, metric in zip(axes, metrics, strict=True):
        for index, (label, runs) in enumerate(groups.items()):
            series = [metric_series(rows, metric) for rows in runs]
            band = mean_band([pair for pair in series if pair[0].size])
            seeds = len(runs)
            style = series_style(index, band.steps.size, sparse=metric.startswith(_SPARSE_PREFIX))
            (line,) = ax.plot(band.steps, band.mean, label=f"{label} (n={seeds})", **style)
            if band.steps.size and seeds > 1:
                interval = (band.steps, band.ci_low, band.ci_high)
                if metric.startswith(_SPARSE_PREFIX):
                    # A band of evaluations at a few steps would be invisible slivers: draw bars.
                    ax.vlines(*interval, color=line.get_color(), alpha=0.4, linewidth=4)
                else:
                    ax.fill_between(*interval, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(f"{metric}: mean over seeds, band = 95% t interval")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        figure.suptitle(title)
    return figure


# --- loss shapes ---------------------------------------------------------------------------

# lp_old = log 0.2 keeps lp = lp_old + log r a valid log-probability for r up to 5.
LOSS_SHAPE_SAMPLING_PROB = 0.2
LOSS_SHAPE_RATIO_RANGE = (0.2, 5.0)
LOSS_SHAPE_POINTS = 241
# Dual clip is off by default; this value is drawn as an extra PPO curve for A < 0.
LOSS_SHAPE_DUAL_CLIP = 3.0


@attrs.frozen
class LossShape:
    """One kernel at one advantage sign: per-token objective o(r) and gradient weight do/dlp(r)."""

    label: str
    ratios: np.ndarray
    objective: np.ndarray
    gradient_weight: np.ndarray


def kernel_token_response(
    loss_name: str,
    ratios: np.ndarray,
    advantage: float,
    *,
    sampling_logprob: float,
    config: Mapping[str, float | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(o_t, do_t/dlp_t) of kernel `loss_name` for a single token at each ratio, by autograd.

    Each ratio is its own one-token batch with lp = lp_old + log r, mask 1 and reduction
    "sum", so o = −loss and do/dlp = −∂loss/∂lp exactly as training computes them.
    """
    import torch

    from grpo.core.losses import get_loss

    kernel = get_loss(loss_name)
    objective = np.empty(len(ratios))
    weight = np.empty(len(ratios))
    sampling_T = torch.tensor([sampling_logprob], dtype=torch.float64)
    advantages_T = torch.tensor([advantage], dtype=torch.float64)
    for index, ratio in enumerate(ratios):
        logprobs_T = (sampling_T + math.log(ratio)).requires_grad_(True)
        loss, _ = kernel(
            logprobs_T, sampling_T, advantages_T, reduction="sum", **dict(config or {})
        )
        (gradient_T,) = torch.autograd.grad(loss, logprobs_T)
        objective[index] = -loss.item()
        weight[index] = -gradient_T.item()
    return objective, weight


def loss_shape_curves(advantage: float, ratios: np.ndarray | None = None) -> list[LossShape]:
    """IS, PPO, CISPO and DRO at their registry defaults (and PPO with dual clip when A < 0)."""
    from grpo.core.losses import get_loss

    grid = (
        np.linspace(*LOSS_SHAPE_RATIO_RANGE, LOSS_SHAPE_POINTS)
        if ratios is None
        else np.asarray(ratios, float)
    )
    sampling_logprob = math.log(LOSS_SHAPE_SAMPLING_PROB)
    variants: list[tuple[str, str, dict[str, float | None]]] = []
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        defaults = {
            key: value for key, value in get_loss(name).defaults.items() if value is not None
        }
        settings = ", ".join(
            f"{key.replace('_threshold', '')}={value:g}" for key, value in defaults.items()
        )
        variants.append((f"{name} ({settings})" if settings else name, name, {}))
        if name == "ppo" and advantage < 0:
            variants.append(
                (
                    f"ppo dual_clip={LOSS_SHAPE_DUAL_CLIP:g}",
                    name,
                    {"dual_clip": LOSS_SHAPE_DUAL_CLIP},
                )
            )
    shapes = []
    for label, name, config in variants:
        objective, weight = kernel_token_response(
            name, grid, advantage, sampling_logprob=sampling_logprob, config=config
        )
        shapes.append(
            LossShape(label=label, ratios=grid, objective=objective, gradient_weight=weight)
        )
    return shapes


# One color per kernel in every panel; IS is drawn wide underneath, since PPO and CISPO
# coincide with it wherever they do not clip.
_KERNEL_STYLES: dict[str, dict[str, Any]] = {
    "importance_sampling": {"color": "tab:blue", "linewidth": 4.5, "alpha": 0.45},
    "ppo": {"color": "tab:orange", "linewidth": 1.8},
    "ppo dual_clip": {"color": "tab:orange", "linewidth": 1.8, "linestyle": "--"},
    "cispo": {"color": "tab:green", "linewidth": 1.8},
    "dro": {"color": "tab:purple", "linewidth": 1.8, "linestyle": ":"},
}


def _kernel_style(label: str) -> dict[str, Any]:
    return next(
        style
        for prefix, style in sorted(_KERNEL_STYLES.items(), key=lambda item: -len(item[0]))
        if label.startswith(prefix)
    )


def loss_shapes_figure(ratios: np.ndarray | None = None) -> Figure:
    """2 x 2 panels: rows = objective o and gradient weight do/dlp, columns = A = +1 and A = −1.

    In each panel `ax.lines[i]` is the i-th curve of `loss_shape_curves` (then the r = 1 marker).
    """
    figure, axes = _grid_figure(4, columns=2, panel_size=(6.0, 4.2))
    for column, advantage in enumerate((1.0, -1.0)):
        objective_ax, weight_ax = axes[column], axes[2 + column]
        for shape in loss_shape_curves(advantage, ratios):
            style = _kernel_style(shape.label)
            objective_ax.plot(shape.ratios, shape.objective, label=shape.label, **style)
            weight_ax.plot(shape.ratios, shape.gradient_weight, label=shape.label, **style)
        sign = (
            "A = +1 (better than the group)" if advantage > 0 else "A = −1 (worse than the group)"
        )
        objective_ax.set_title(f"per-token objective o, {sign}")
        weight_ax.set_title(f"gradient weight do/dlp, {sign}")
        for ax in (objective_ax, weight_ax):
            ax.axvline(1.0, color="gray", linewidth=0.8, alpha=0.6)
            ax.set_xlabel("ratio r = exp(lp − lp_old)")
            ax.grid(alpha=0.3)
        weight_ax.legend(fontsize="small")
    figure.suptitle(
        "Loss kernels of grpo.core.losses at their defaults, one token with "
        f"lp_old = log {LOSS_SHAPE_SAMPLING_PROB:g}\n"
        "(CISPO and DRO objectives are surrogates in lp whose values are not comparable; "
        "their gradients are)"
    )
    return figure


# --- command line --------------------------------------------------------------------------


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo plot RUN_DIR... [--metrics M...] [--out FILE.png]`."""
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help=f"run directories with a {run_files.METRICS_FILE}, or TensorBoard log directories "
        "(another trainer's run)",
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        metavar="METRIC",
        help="metrics to plot, one panel each "
        f"(None: those of {', '.join(DEFAULT_PLOT_METRICS)} that were logged); "
        "a name without its prefix, e.g. clip_fraction, matches each run's <loss_fn>/clip_fraction",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output PNG (None: RUN_DIR/metrics.png for one run, metrics.png otherwise)",
    )
    paths.add_force_argument(parser, "--out file")


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """A legend label per run: its directory name, or the path as given when names collide."""
    names = [Path(run_dir).resolve().name for run_dir in run_dirs]
    return [
        name if names.count(name) == 1 else str(run_dir)
        for name, run_dir in zip(names, run_dirs, strict=True)
    ]


def default_metrics(runs: Mapping[str, MetricRows]) -> list[str]:
    """The default panels that at least one run can draw."""
    all_keys = set().union(*(metric_keys(rows) for rows in runs.values()))
    return [
        metric
        for metric in DEFAULT_PLOT_METRICS
        if any(
            resolve_metric_keys(metric, metric_keys(rows), exact_somewhere=metric in all_keys)
            for rows in runs.values()
        )
    ]


def run_plot(args: argparse.Namespace) -> int:
    """`grpo plot`: write the metrics PNG of the given runs; 0 on success, 2 on bad input."""
    labels = run_labels(args.run_dirs)
    try:
        runs = {
            label: read_run_metrics(run_dir)
            for label, run_dir in zip(labels, args.run_dirs, strict=True)
        }
        metrics = list(args.metrics) if args.metrics else default_metrics(runs)
        if not metrics:
            raise ValueError(
                f"nothing to plot: no run logged any of {', '.join(DEFAULT_PLOT_METRICS)}"
            )
        if args.out:
            reads = [read for run_dir in args.run_dirs for read in read_paths("RUN_DIR", run_dir)]
            paths.check_out(Path(args.out), force=args.force, reads=reads)
        figure = metrics_figure(runs, metrics)
    except (FileNotFoundError, ValueError) as error:
        print(f"grpo plot: error: {error}", file=sys.stderr)
        return 2
    out = args.out or (
        Path(args.run_dirs[0]) / "metrics.png" if len(args.run_dirs) == 1 else Path("metrics.png")
    )
    print(f"wrote {save_figure(figure, out)} ({len(metrics)} metrics x {len(runs)} runs)")
    return 0


def add_plot_losses_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo plot-losses [--out FILE.png]`."""
    parser.add_argument("--out", default=LOSS_SHAPES_PNG, help="output PNG")
    paths.add_force_argument(parser, "--out file")


def run_plot_losses(args: argparse.Namespace) -> int:
    """`grpo plot-losses`: write the objective / gradient-weight figure of the loss kernels."""
    if args.out != LOSS_SHAPES_PNG:
        paths.check_out(Path(args.out), force=args.force)
    print(f"wrote {save_figure(loss_shapes_figure(), args.out)}")
    return 0
