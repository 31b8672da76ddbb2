"""`grpo train` under load: wall time beside competing processes, as a ratio to quiet.

`python -m benchmarks.load [--quick]`

One fixed short run (`grpo train --steps 8 --eval-every 0`, the built-in tiny model, its
wall time from start to exit) quiet, beside a plain CPU hog (`while True: pass`), beside a
torch process multiplying 128 x 128 matrices on torch's default threads, beside both, and
two runs at once (the slower of the two), under two thread settings alternated within the
run: torch's old default (`OMP_NUM_THREADS` = torch's default count, which the thread
policy leaves alone) and the local backend's thread policy (nothing set,
`grpo/backends/local/threads.py`). Each ratio divides by the quiet time of the same
setting. The competitors are started before and killed after each timed run, by this
script. --quick: a 1-step run of 2 x 4 completions, quiet and beside both competitors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import attrs

from benchmarks.common import (
    DEFAULT_THREADS,
    argument_parser,
    markdown_table,
    print_header,
    ratio,
)
from grpo.backends.local.threads import THREAD_ENV_VARS

FULL_RUN = ("--steps", "8", "--eval-every", "0")
QUICK_RUN = ("--steps", "1", "--eval-every", "0", "--batch-size", "2", "--group-size", "4")
CPU_HOG = "while True: pass"
TORCH_HOG = "import torch\nleft = torch.randn(128, 128)\nwhile True:\n    left @ left"
COMPETITOR_START_S = 2.0  # a torch competitor is importing torch, not competing, before this
RUN_TIMEOUT_S = 900.0


@attrs.frozen
class Scenario:
    """What runs beside the timed `grpo train`: competitor programs and extra training runs."""

    label: str
    competitors: tuple[str, ...] = ()
    runs: int = 1


# The targets first (quiet, both competitors, two runs), so a stopped run has them.
SCENARIOS = (
    Scenario("quiet"),
    Scenario("torch process + CPU hog", (TORCH_HOG, CPU_HOG)),
    Scenario("two grpo train runs at once", runs=2),
    Scenario("CPU hog", (CPU_HOG,)),
    Scenario("torch process", (TORCH_HOG,)),
)
QUICK_SCENARIOS = SCENARIOS[:2]

SETTINGS = (
    (f"old default ({DEFAULT_THREADS} threads)", {"OMP_NUM_THREADS": str(DEFAULT_THREADS)}),
    ("thread policy (auto)", {}),
)


def settings_env(overrides: dict[str, str]) -> dict[str, str]:
    """This process's environment without thread settings, plus `overrides`."""
    env = {key: value for key, value in os.environ.items() if key not in THREAD_ENV_VARS}
    return {**env, **overrides}


def time_runs(run_args: Sequence[str], env: dict[str, str], scenario: Scenario) -> float:
    """Wall seconds of the slowest of `scenario.runs` concurrent `grpo train` runs, with the
    scenario's competitors running throughout (killed afterwards, whatever happens)."""
    competitors: list[subprocess.Popen[bytes]] = []
    runs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-load-") as root:
        try:
            for program in scenario.competitors:
                competitors.append(
                    subprocess.Popen(
                        [sys.executable, "-c", program],
                        env=settings_env({}),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            if competitors:
                time.sleep(COMPETITOR_START_S)
            started = time.perf_counter()
            for index in range(scenario.runs):
                command = [sys.executable, "-m", "grpo", "train", *run_args]
                command += ["--run-dir", f"{root}/run{index}", "--swanlab-mode", "disabled"]
                runs.append(
                    subprocess.Popen(
                        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                    )
                )
            finished = []
            for run in runs:
                _, stderr = run.communicate(timeout=RUN_TIMEOUT_S)
                if run.returncode != 0:
                    raise RuntimeError(f"grpo train failed: {stderr.decode()[-2000:]}")
                finished.append(time.perf_counter() - started)
            return max(finished)
        finally:
            for process in competitors + runs:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)


def _exit_on_sigterm(signal_number: int, _frame: object) -> None:
    raise SystemExit(128 + signal_number)


def load_average() -> str:
    """The 1-minute load average."""
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Time the run in every scenario under both thread settings and print the table."""
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    run_args, scenarios = (QUICK_RUN, QUICK_SCENARIOS) if args.quick else (FULL_RUN, SCENARIOS)
    print_header(
        "grpo train under load (tiny model)",
        "python -m benchmarks.load" + (" --quick" if args.quick else ""),
    )
    print(f"run: `grpo train {' '.join(run_args)}`, wall time to exit, one run per cell\n")
    headers = [
        "beside the run",
        f"{SETTINGS[0][0]} s",
        "x quiet",
        f"{SETTINGS[1][0]} s",
        "x quiet",
        "old / policy",
        "load average before each",
    ]
    # The header first and each row once measured: a run stopped part way keeps its rows.
    print(markdown_table(headers, []), flush=True)
    (old_label, _), (new_label, _) = SETTINGS
    quiet: dict[str, float] = {}
    for index, scenario in enumerate(scenarios):
        # Alternate which setting goes first, so neither always meets the same load.
        order = SETTINGS if index % 2 == 0 else SETTINGS[::-1]
        seconds: dict[str, float] = {}
        loads = []
        for label, overrides in order:
            loads.append(load_average())
            seconds[label] = time_runs(run_args, settings_env(overrides), scenario)
            quiet.setdefault(label, seconds[label])  # the first scenario is the quiet one
        row = [
            scenario.label,
            f"{seconds[old_label]:.1f}",
            ratio(seconds[old_label], quiet[old_label]),
            f"{seconds[new_label]:.1f}",
            ratio(seconds[new_label], quiet[new_label]),
            ratio(seconds[old_label], seconds[new_label]),
            " / ".join(loads),
        ]
        print("| " + " | ".join(row) + " |", flush=True)
    print()
    return 0


if __name__ == "__main__":
    # A SIGTERM (a CI timeout, `kill`) unwinds through the `finally` that kills competitors.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    raise SystemExit(main())
