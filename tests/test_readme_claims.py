"""The README's measured claims about the default run, checked so they cannot drift.

The figures are exact on the hardware they were measured on (an AMD CPU with AVX-512 and
torch 2.13.0's MKL, every forcible CPU path: see docs/DESIGN.md, "Reproducibility"). On
other CPUs float rounding can flip a sampled token and send the run along another path of
the same quality, so there the test checks only that the run learns as much, to three
standard errors of a 300-problem test (3 x 0.026).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from grpo.training.config import TrainConfig
from grpo.training.run_files import read_metrics
from tests.runs import quiet_train

README = Path(__file__).resolve().parents[1] / "README.md"
TEST_REWARD_NOISE = 3 * 0.026
TRAIN_REWARD_NOISE = 0.05  # a 10-step mean over 640 completions


def measured_on_this_hardware() -> bool:
    """Whether this CPU is of the kind the README's figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    vendor = cpuinfo.read_text() if cpuinfo.exists() else ""
    return (
        "AuthenticAMD" in vendor
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.__version__.startswith("2.13.0")
    )


def readme_figures() -> tuple[list[float], list[float]]:
    """(mean train reward per 10 steps, test reward at steps 0/40/80) as the README states."""
    text = README.read_text()
    row = re.search(r"^\| mean train reward \|(.*)\|$", text, re.M)
    tests = re.search(
        r"(\d\.\d{3}) before\s+training, (\d\.\d{3}) at step 40, (\d\.\d{3}) at step 80", text
    )
    assert row and tests, "the README's default-run figures are not where this test reads them"
    return [float(cell) for cell in row.group(1).split("|")], [float(v) for v in tests.groups()]


@pytest.mark.slow
def test_the_default_run_gives_the_readme_figures(tmp_path: Path) -> None:
    train_means, test_rewards = readme_figures()
    rows = read_metrics(quiet_train(TrainConfig(run_dir=str(tmp_path / "default"))).run_dir)
    trained = [row["reward"] for row in rows if row["step"] >= 1]
    measured_means = [round(sum(trained[i : i + 10]) / 10, 3) for i in range(0, 80, 10)]
    measured_tests = [round(row["test/reward"], 3) for row in rows if "test/reward" in row]
    if measured_on_this_hardware():
        assert measured_means == train_means
        assert measured_tests == test_rewards
    else:
        assert measured_tests[0] == test_rewards[0]  # before training: the shipped weights
        for measured, stated in zip(measured_tests, test_rewards, strict=True):
            assert abs(measured - stated) <= TEST_REWARD_NOISE, (measured_tests, test_rewards)
        for measured, stated in zip(measured_means, train_means, strict=True):
            assert abs(measured - stated) <= TRAIN_REWARD_NOISE, (measured_means, train_means)
