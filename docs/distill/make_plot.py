"""The OPD vs GRPO plot of docs/distill/README.md from the experiment's run directories.

python docs/distill/make_plot.py RUNS_ROOT  (every run directory directly under it)

One line per recipe: the mean over seeds of test/reward at each evaluation, with its 95% t
interval as a band (docs/FORMULAS.md, "Evaluation metrics"); on the token axes a point's x
is the mean over seeds of the cumulative tokens at that evaluation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.core.evaluation import t_interval  # noqa: E402
from grpo.training.run.run_files import merge_rows_by_step, read_config, read_metrics  # noqa: E402

X_AXES = (
    ("step", "training step"),
    ("usage/cum_completion_tokens", "sampled completion tokens"),
    ("usage/cum_tokens", "all tokens (sampled, trained, teacher)"),
)
NAMES = {"grpo": "GRPO (task reward)", "distill": "OPD from the teacher"}


def curves(run_dir: Path) -> dict[str, list[float]]:
    """test/reward and the x axes at every evaluated row of a run."""
    rows = [row for row in merge_rows_by_step(read_metrics(run_dir)) if "test/reward" in row]
    return {
        key: [float(row.get(key, 0.0)) for row in rows] for key in ("test/reward", *dict(X_AXES))
    }


def main(root: Path) -> None:
    figure, axes = plt.subplots(1, len(X_AXES), figsize=(15, 4), sharey=True)
    colors = {"grpo": "tab:blue", "distill": "tab:orange"}
    by_recipe: dict[str, list[dict[str, list[float]]]] = {}
    for run_dir in sorted(path.parent for path in root.glob("*/config.json")):
        recipe = str(read_config(run_dir).get("recipe", "grpo"))
        found = curves(run_dir)
        by_recipe.setdefault(recipe, []).append(found)
        print(run_dir.name, [round(value, 3) for value in found["test/reward"]])
    for recipe, runs in by_recipe.items():
        points = min(len(run["test/reward"]) for run in runs)
        rewards = np.array([run["test/reward"][:points] for run in runs])
        mean = rewards.mean(axis=0)
        bands = [t_interval(list(rewards[:, index])) for index in range(points)]
        label = f"{NAMES.get(recipe, recipe)} ({len(runs)} seeds)"
        for axis, (key, axis_label) in zip(axes, X_AXES, strict=True):
            xs = np.array([run[key][:points] for run in runs]).mean(axis=0)
            axis.plot(xs, mean, marker="o", color=colors.get(recipe), label=label)
            if all(band is not None for band in bands):
                axis.fill_between(xs, [band.low for band in bands], [band.high for band in bands],
                                  color=colors.get(recipe), alpha=0.2)  # fmt: skip
            axis.set_xlabel(axis_label)
        print(recipe, "mean", [round(float(value), 3) for value in mean])
    axes[0].set_ylabel("test reward (mean; band: 95% t)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(Path(__file__).with_name("opd_vs_grpo.png"), dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
