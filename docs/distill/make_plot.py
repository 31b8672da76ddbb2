"""The OPD vs GRPO plot of docs/distill/README.md from the experiment's run directories.

python docs/distill/make_plot.py RUNS_ROOT  (every run directory directly under it)
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.training.run_files import merge_rows_by_step, read_config, read_metrics  # noqa: E402

X_AXES = (
    ("step", "training step"),
    ("usage/cum_completion_tokens", "sampled completion tokens"),
    ("usage/cum_tokens", "all tokens (sampled, trained, teacher)"),
)


def curves(run_dir: Path) -> dict[str, list[float]]:
    """test/reward and the x axes at every evaluated row of a run."""
    rows = [row for row in merge_rows_by_step(read_metrics(run_dir)) if "test/reward" in row]
    return {
        key: [float(row.get(key, 0.0)) for row in rows] for key in ("test/reward", *dict(X_AXES))
    }


def main(root: Path) -> None:
    figure, axes = plt.subplots(1, len(X_AXES), figsize=(15, 4), sharey=True)
    colors = {"grpo": "tab:blue", "distill": "tab:orange"}
    for run_dir in sorted(path.parent for path in root.glob("*/config.json")):
        recipe = str(read_config(run_dir).get("recipe", "grpo"))
        found = curves(run_dir)
        for axis, (key, label) in zip(axes, X_AXES, strict=True):
            axis.plot(found[key], found["test/reward"], marker="o", color=colors[recipe],
                      label=run_dir.name)  # fmt: skip
            axis.set_xlabel(label)
        print(run_dir.name, [round(value, 3) for value in found["test/reward"]])
    axes[0].set_ylabel("test reward")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(Path(__file__).with_name("opd_vs_grpo.png"), dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
