"""The sampler's guarantee on every CPU path torch can be forced to on this machine.

A float32 kernel path that changes rounding with the batch (another vector width in ATen,
another BLAS code branch) is found here, whatever CPU CI lands on: each path torch's
dispatcher can be forced to (``ATEN_CPU_CAPABILITY``, at most the CPU's own) reruns the
sampler's invariance tests in a fresh interpreter, together with an older MKL code branch
(``MKL_ENABLE_INSTRUCTIONS``; a BLAS that ignores it runs its usual branch). The guarantee
itself is stated in ``docs/DESIGN.md`` ("Reproducibility") and ``tests/invariance.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.training.run.run_files import read_metrics
from tests.invariance import assert_same_rows
from tests.runs import comparable, quiet_train, tiny_config

ROOT = Path(__file__).resolve().parents[2]

# torch's x86 dispatch levels, oldest first; other CPUs can be forced to "default" only.
_X86_LEVELS = ["DEFAULT", "AVX2", "AVX512"]

# The tests that compare one request's results across batch compositions and thread counts.
INVARIANCE_TESTS = (
    "test_cpu_capability_is_the_forced_one or identical_alone_and_batched or "
    "exact_when_finished_rows_leave or threads_and_asyncio"
)


def forcible_capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY levels this CPU runs: every x86 level up to its own, or default."""
    native = torch.backends.cpu.get_cpu_capability()
    if native in _X86_LEVELS:
        return _X86_LEVELS[: _X86_LEVELS.index(native) + 1]
    return ["DEFAULT", native] if native != "DEFAULT" else ["DEFAULT"]


# Each capability with the MKL branch of its generation (SSE4_2 beside the scalar ATen path).
_MKL_BRANCH = {"DEFAULT": "SSE4_2", "AVX2": "AVX2"}


@pytest.mark.slow
@pytest.mark.parametrize("capability", forcible_capabilities())
def test_the_sampler_guarantee_holds_on_every_forcible_cpu_path(capability: str) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    env.pop("MKL_ENABLE_INSTRUCTIONS", None)
    if capability in _MKL_BRANCH:
        env["MKL_ENABLE_INSTRUCTIONS"] = _MKL_BRANCH[capability]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", INVARIANCE_TESTS]
        + ["tests/backends/test_local_sampling.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{capability}: {result.stdout[-3000:]}{result.stderr[-2000:]}"
    assert " passed" in summary and "skipped" not in summary, summary


@pytest.mark.slow
def test_a_run_gives_the_same_numbers_on_one_and_two_threads(tmp_path: Path) -> None:
    rows = {}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            config = tiny_config(tmp_path, f"threads-{threads}", steps=3, threads=threads)
            rows[threads] = comparable(read_metrics(quiet_train(config).run_dir))
    finally:
        torch.set_num_threads(previous)
    assert_same_rows(rows[2], rows[1], "2 threads against 1")
