"""The numbers of an experiment's report, from run directories: per run, then per configuration.

run dirs -> `RunData` -> `RunStats` -> `ConfigSummary` (mean ± sample std over seeds, and the
95% t interval of the mean); `separation` says whether the best is separated from the rest. Pure
functions except `read_run`, so the statistics are testable without processes or pictures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo.core.evaluation import Interval, intervals_overlap, t_interval
from grpo.tools.plots import metric_keys, metric_series, read_run_metrics
from grpo.training.run import run_files

# A run was on-policy when no token's ratio left 1 ± RATIO_TOLERANCE; the clip-based losses
# reduce to importance sampling when at most CLIP_TOLERANCE of the tokens were ever clipped.
RATIO_TOLERANCE = 1e-3
CLIP_TOLERANCE = 1e-3
# The kernels whose gradient is r·A on every unclipped token, so zero clipping makes them equal.
CLIP_EQUIVALENT_LOSSES = frozenset({"importance_sampling", "ppo", "cispo"})


@attrs.frozen
class RunData:
    """A run directory's config ({} if absent), merged metrics rows, summary (None if running)."""

    run_dir: Path
    config: Mapping[str, Any]
    rows: list[dict[str, Any]]
    summary: Mapping[str, Any] | None


def read_run(run_dir: str | Path) -> RunData:
    """Read a run directory, whatever state it is in (a run that failed early may hold nothing)."""
    directory = Path(run_dir)
    has_config = (directory / run_files.CONFIG_FILE).is_file()
    has_metrics = (directory / run_files.METRICS_FILE).is_file()
    return RunData(
        run_dir=directory,
        config=run_files.read_config(directory) if has_config else {},
        rows=read_run_metrics(directory) if has_metrics else [],
        summary=run_files.read_summary(directory),
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
    prefixes = sorted(
        {key.split("/", 1)[0] for key in metric_keys(run.rows) if key.endswith("/clip_fraction")}
    )
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
    tokens: float | None = None
    """Every token the run used (usage/cum_tokens; summary.json's total once finished)."""
    cost: float | None = None
    """Its cost in `currency`, from the prices the user gave the run (None without prices)."""
    currency: str | None = None
    mismatch_max_abs_log: float | None = None
    """max over steps of `mismatch/max_abs_log_ratio` (fresh rollouts, before any update)."""
    mismatch_kl: float | None = None
    """mean over steps of `mismatch/kl_k3`."""

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
        clip_low_fraction=_series_reduce(
            run, loss_key("clip_low_fraction"), lambda values: values.mean()
        ),
        clip_high_fraction=_series_reduce(
            run, loss_key("clip_high_fraction"), lambda values: values.mean()
        ),
        ratio_mean=_series_reduce(run, loss_key("ratio_mean"), lambda values: values.mean()),
        ratio_min=_series_reduce(run, loss_key("ratio_min"), lambda values: values.min()),
        ratio_max=_series_reduce(run, loss_key("ratio_max"), lambda values: values.max()),
        **run_usage(run),
        mismatch_max_abs_log=_series_reduce(
            run, "mismatch/max_abs_log_ratio", lambda values: values.max()
        ),
        mismatch_kl=_series_reduce(run, "mismatch/kl_k3", lambda values: values.mean()),
    )


def run_usage(run: RunData) -> dict[str, Any]:
    """`tokens`, `cost` and `currency` of a run: summary.json's totals, else the last row's."""
    summary = run.summary or {}
    last = run.rows[-1] if run.rows else {}
    usage = summary.get("usage")
    tokens = sum(usage.values()) if isinstance(usage, Mapping) else last.get("usage/cum_tokens")
    priced = summary.get("cost")
    if isinstance(priced, Mapping):
        return {"tokens": tokens, "cost": priced.get("total"), "currency": priced.get("currency")}
    currency = run.config.get("price_currency") if "cost/cum" in last else None
    return {"tokens": tokens, "cost": last.get("cost/cum"), "currency": currency}


@attrs.frozen
class Stat:
    """Mean, sample standard deviation (ddof 1) and 95% t interval of the mean over the seeds'
    values present (std and interval None for one value; docs/FORMULAS.md, "Evaluation
    metrics")."""

    mean: float | None
    std: float | None
    n: int
    interval: Interval | None = None

    def format(self, digits: int = 3) -> str:
        """The stat as `mean ± std`, the mean alone for one value, "–" for none."""
        if self.mean is None:
            return "–"
        if self.std is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

    def format_interval(self, digits: int = 3) -> str:
        """The stat as `mean [low, high]` (its 95% interval), the mean alone for one value."""
        if self.mean is None:
            return "–"
        if self.interval is None:
            return f"{self.mean:.{digits}f}"
        low, high = self.interval.low, self.interval.high
        return f"{self.mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def mean_std(values: Iterable[float | None]) -> Stat:
    """Stat of the non-None values: mean Σx/n, sample std sqrt(Σ(x − mean)²/(n − 1)), and
    the t interval mean ± t_{0.975, n−1}·std/√n."""
    present = [float(value) for value in values if value is not None]
    count = len(present)
    if count == 0:
        return Stat(mean=None, std=None, n=0)
    mean = sum(present) / count
    std = (
        math.sqrt(sum((value - mean) ** 2 for value in present) / (count - 1))
        if count > 1
        else None
    )
    return Stat(mean=mean, std=std, n=count, interval=t_interval(present))


def separation(entries: Sequence[tuple[str, Stat]], *, what: str, more_seeds: str) -> str | None:
    """A sentence on whether the first entry (the best) is separated from the others by their
    95% intervals: overlapping intervals are reported as no winner. None for fewer than two.
    ``more_seeds`` is how the experiment's own command asks for three seeds (compare: a flag,
    sweep: its file), recommended when one seed gives no interval."""
    present = [(label, stat) for label, stat in entries if stat.mean is not None]
    if len(present) < 2:
        return None
    if any(stat.interval is None for _, stat in present):
        return (
            f"{what}: with one seed of a configuration there is no interval, so the order is "
            f"not evidence of a difference; run 3 seeds or more ({more_seeds})."
        )
    (best, best_stat), others = present[0], present[1:]
    assert best_stat.interval is not None
    tied = [
        f"`{label}`"
        for label, stat in others
        if stat.interval is not None and intervals_overlap(best_stat.interval, stat.interval)
    ]
    seeds = min(stat.n for _, stat in present)
    if not tied:
        return (
            f"{what}: `{best}` is ahead, and its 95% t interval over seeds overlaps none of "
            "the others'."
        )
    return (
        f"{what}: no winner. The 95% t intervals over seeds of `{best}` and {', '.join(tied)} "
        f"overlap, so these runs ({seeds}+ seeds each) do not separate them; more seeds may."
    )


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
        max_clip is not None
        and max_clip <= CLIP_TOLERANCE
        and bool(losses)
        and losses <= CLIP_EQUIVALENT_LOSSES
    )
    if not (ratio_is_one or never_clipped):
        return None
    mismatches = [run.mismatch_max_abs_log for run in stats if run.mismatch_max_abs_log is not None]
    kls = [run.mismatch_kl for run in stats if run.mismatch_kl is not None]
    max_mismatch = max(mismatches) if mismatches else None
    deviation_text = f"{max_deviation:.2g}" if max_deviation is not None else "not logged"
    clip_text = f"{max_clip:.2%}" if max_clip is not None else "not logged"
    mismatch_text = (
        f"at most {max_mismatch:.2g} in |log ρ| (mean KL k3 up to {max(kls):.2g})"
        if max_mismatch is not None and kls
        else "not logged"
    )
    if ratio_is_one:
        why = (
            "The ratio never left 1 by more than that, so the policy that computed each loss was, "
            "to that tolerance, the one that sampled: importance sampling, PPO and CISPO all had "
            "the gradient A·∇lp."
        )
    else:
        why = (
            "The ratio did leave 1 (the measured sampler–trainer mismatch above, plus the "
            "updates' own movement), but no clip acted on it, so PPO and CISPO reduced to "
            "importance sampling (gradient r·A on every token)."
        )
    return (
        "**WARNING: these runs were too on-policy for the losses to differ.** "
        f"Over all runs, max |ratio − 1| = {deviation_text}, the largest mean clip fraction "
        f"is {clip_text}, and the measured sampler–trainer mismatch before each step's first "
        f"update (`mismatch/*`) is {mismatch_text}. {why} Any difference in this table is "
        "seed noise. Make the updates off-policy to compare the losses: "
        "several optimizer steps per batch (`--num-substeps 4`, `--epochs 2`) or stale rollouts "
        "(`--max-steps-off-policy 1`)."
    )


def missing_runs(stats: Sequence[RunStats]) -> list[RunStats]:
    """Runs that did not finish (crashed, killed or failed): the report must say so."""
    return [run for run in stats if not run.finished]
