"""The default training step of this tree against the tree before issue 49's refactor.

`python -m benchmarks.refactor_step [--quick] [--steps N] [--rounds R] [--before REV] [--now REV]`

Issue 49 asked that the refactored training shell keep `benchmarks.step`'s median step
within 5% of the code before it (REV, default 800dfb0: the commit the refactor started
from). The old tree is extracted with `git archive REV grpo` into a temporary folder, so
the benchmark needs this repository's git history (not a shallow clone) and nothing else:
it runs offline, with the built-in model and prompts.

Each run is `python -m grpo train --steps N --eval-every 0 --save-every 0` (the default
job: 8 prompts x 8 completions of up to 24 tokens, LoRA rank 32, 2 minibatches a step) in
a subprocess of its own: the two trees are both the package `grpo`, so each run gets the
tree it runs through PYTHONPATH (this tree: the folder above the `grpo` this process
imports; with --now REV, that commit, extracted as the old one is, so edits made to the
working tree while the benchmark runs do not reach it). `OMP_NUM_THREADS=1` pins torch to
1 thread in both (the local backend's thread policy leaves a count the user set alone).
The two trees alternate R times, in the order old-new, new-old, ... so a drift of the
machine's load falls on both alike. The step time is each run's `time/step` metric (the
same bracket in both trees: `lifecycle.run_step`, the recipe's step and any evaluation);
step 1 (warm-up) is left out. As a check on work done outside that bracket (logging), the
table also gives each run's loop wall time per step: (summary.json's `wall_time_s` - step
1's `time/step`) / (N - 1).
Each pair's non-time metrics are compared too (the keys both trees log): the two trees
must train alike, bit for bit.

`tests/test_benchmarks.py` runs --quick (two interpreter starts and 3 steps each, ~20 s)
where the repository has the old commit, and skips it where it has not (a shallow clone).

--quick: 3 steps, 1 round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import attrs

import grpo
from benchmarks.common import argument_parser, markdown_table, print_header

BEFORE_REFACTOR = "800dfb0"  # issue 49's "today": the commit its refactor started from
TIME_PREFIX = "time/"


@attrs.frozen
class RunTimes:
    """One `grpo train` run's per-step times (step 1 left out) and its non-time metrics."""

    step_s: tuple[float, ...]
    wall_per_step_s: float
    trained: tuple[dict[str, float], ...]

    @property
    def median_step_s(self) -> float:
        """The median `time/step` after the warm-up step."""
        return statistics.median(self.step_s)


def this_tree() -> Path:
    """The folder holding the `grpo` package this process imports (a PYTHONPATH entry)."""
    return Path(grpo.__file__).resolve().parents[1]


def extract_tree(revision: str, repository: Path, into: Path) -> Path:
    """`git archive revision grpo` unpacked under `into`; the folder to put on PYTHONPATH."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(repository), "archive", "--format=tar", revision, "grpo"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        raise SystemExit(
            f"benchmarks.refactor_step: cannot extract revision {revision!r} from "
            f"{repository} with git archive ({detail.decode(errors='replace').strip() or error});"
            " run it from a full clone of the repository, or pass --before with a commit it has"
        ) from None
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_tree(tree: Path, steps: int, run_dir: Path) -> RunTimes:
    """The default job for `steps` steps through the `grpo` under `tree`, at 1 torch thread."""
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "grpo", "train", "--steps", str(steps), "--eval-every", "0"]
    command += ["--save-every", "0", "--run-dir", str(run_dir)]
    finished = subprocess.run(command, env=env, cwd=run_dir.parent, capture_output=True, text=True)
    if finished.returncode != 0:
        tail = (finished.stdout + finished.stderr).strip().splitlines()[-15:]
        raise SystemExit(
            f"benchmarks.refactor_step: `grpo train` under {tree} failed "
            f"(exit {finished.returncode}):\n" + "\n".join(tail)
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wall_s = json.loads((run_dir / "summary.json").read_text())["wall_time_s"]
    return RunTimes(
        step_s=tuple(row["time/step"] for row in rows[1:]),
        wall_per_step_s=(wall_s - rows[0]["time/step"]) / (steps - 1),
        trained=tuple(
            {key: value for key, value in row.items() if not key.startswith(TIME_PREFIX)}
            for row in rows
        ),
    )


def metric_differences(old: RunTimes, new: RunTimes) -> set[str]:
    """The non-time metrics, of the keys both runs log, whose values differ in some step."""
    if len(old.trained) != len(new.trained):
        return {"(number of rows)"}
    return {
        key
        for old_row, new_row in zip(old.trained, new.trained, strict=True)
        for key in set(old_row) & set(new_row)
        if old_row[key] != new_row[key]
    }


def spread(values: Sequence[float]) -> str:
    """median (min-max) of ratios, 3 decimals."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate the default job through the tree before the refactor and this one."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (first left out)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, alternated")
    parser.add_argument(
        "--before",
        default=BEFORE_REFACTOR,
        help="the old tree's git revision (default %(default)s)",
    )
    parser.add_argument(
        "--now", default=None, help="the new tree's git revision (default: this working tree)"
    )
    args = parser.parse_args(argv)
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    if steps < 2 or rounds < 1:
        parser.error("--steps must be at least 2 (step 1 is left out) and --rounds at least 1")
    command = "python -m benchmarks.refactor_step" + (
        " --quick" if args.quick else f" --steps {steps} --rounds {rounds}"
    )
    if args.before != BEFORE_REFACTOR:
        command += f" --before {args.before}"
    if args.now is not None:
        command += f" --now {args.now}"
    print_header(f"The default step: this tree against {args.before} (1 torch thread)", command)
    new_tree = this_tree()
    times: dict[str, list[RunTimes]] = {"before": [], "now": []}
    differing: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-refactor-") as root:
        trees = {
            "before": extract_tree(args.before, new_tree, Path(root) / "before"),
            "now": new_tree
            if args.now is None
            else extract_tree(args.now, new_tree, Path(root) / "now"),
        }
        for round_index in range(rounds):
            order = ("before", "now") if round_index % 2 == 0 else ("now", "before")
            for label in order:
                run_dir = Path(root) / f"run-{label}-{round_index}"
                times[label].append(run_tree(trees[label], steps, run_dir))
            differing |= metric_differences(times["before"][-1], times["now"][-1])
    rows = []
    for round_index, (old, new) in enumerate(zip(times["before"], times["now"], strict=True)):
        rows.append(
            [
                str(round_index + 1),
                f"{old.median_step_s * 1e3:.0f}",
                f"{new.median_step_s * 1e3:.0f}",
                f"{new.median_step_s / old.median_step_s:.3f}",
                f"{old.wall_per_step_s * 1e3:.0f}",
                f"{new.wall_per_step_s * 1e3:.0f}",
                f"{new.wall_per_step_s / old.wall_per_step_s:.3f}",
            ]
        )
    print(
        f"{steps} steps per run, {rounds} run(s) of each tree alternated; step 1 of each run "
        f"left out. before: `git archive {args.before}`; now: "
        + (str(new_tree) if args.now is None else f"`git archive {args.now}`")
        + "\n"
    )
    print(
        markdown_table(
            [
                "round",
                "before median ms/step",
                "now median ms/step",
                "now/before",
                "before wall ms/step",
                "now wall ms/step",
                "now/before (wall)",
            ],
            rows,
        )
    )
    pooled = {label: [s for run in runs for s in run.step_s] for label, runs in times.items()}
    step_ratios = [
        new.median_step_s / old.median_step_s
        for old, new in zip(times["before"], times["now"], strict=True)
    ]
    wall_ratios = [
        new.wall_per_step_s / old.wall_per_step_s
        for old, new in zip(times["before"], times["now"], strict=True)
    ]
    before_ms = statistics.median(pooled["before"]) * 1e3
    now_ms = statistics.median(pooled["now"]) * 1e3
    print(
        f"\nmedian time/step over all runs: before {before_ms:.0f} ms, now {now_ms:.0f} ms, "
        f"now/before {now_ms / before_ms:.3f}"
    )
    print(
        f"now/before per round, median (min-max): time/step {spread(step_ratios)}, "
        f"wall {spread(wall_ratios)}"
    )
    print(
        "non-time metrics (the keys both trees log) identical in every round: "
        + ("yes" if not differing else "NO, differing: " + ", ".join(sorted(differing)))
    )
    before_keys, now_keys = (set(times[label][0].trained[0]) for label in ("before", "now"))
    for label, keys in (("before", before_keys - now_keys), ("now", now_keys - before_keys)):
        if keys:
            print(f"keys only {label} logs: {', '.join(sorted(keys))}")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"load average at the end (1/5/15 min): {load}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
