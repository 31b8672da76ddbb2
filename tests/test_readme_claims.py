"""The docs' measured claims, checked so they cannot drift: the default run (docs/training.md,
"The default run") and the DPO example (docs/sft-dpo-distill.md, "Preference training").

The figures are exact on the hardware they were measured on (an Intel CPU with AVX-512 and
torch 2.13.0's MKL, 1 or 2 threads, every forcible CPU path: see docs/DESIGN.md,
"Reproducibility"; the earlier one-row trainer gave them on an AMD CPU, where the
shared-prefix trainer has not been measured). On other CPUs float rounding can flip a
sampled token and send the run along another path of the same quality, so there the test
checks only that the run learns as much, to three standard errors of a 300-problem test
(3 x 0.026).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig
from tests.runs import quiet_train

ROOT = Path(__file__).resolve().parents[1]
TRAINING_GUIDE = ROOT / "docs" / "training.md"
DPO_GUIDE = ROOT / "docs" / "sft-dpo-distill.md"
TEST_REWARD_NOISE = 3 * 0.026
TRAIN_REWARD_NOISE = 0.05  # a 10-step mean over 640 completions


def measured_on_this_hardware() -> bool:
    """Whether this CPU is of the kind the docs' figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    vendor = cpuinfo.read_text() if cpuinfo.exists() else ""
    return (
        "GenuineIntel" in vendor
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.__version__.startswith("2.13.0")
    )


def readme_figures() -> tuple[list[float], list[float]]:
    """(mean train reward per 10 steps, test reward at steps 0/40/80) as the guide states."""
    text = TRAINING_GUIDE.read_text()
    row = re.search(r"^\| mean train reward \|(.*)\|$", text, re.M)
    tests = re.search(
        r"(\d\.\d{3}) before\s+training, (\d\.\d{3}) at step 40, (\d\.\d{3}) at step 80", text
    )
    assert row and tests, "docs/training.md's default-run figures are not where they are read"
    return [float(cell) for cell in row.group(1).split("|")], [float(v) for v in tests.groups()]


@pytest.mark.slow
def test_the_default_run_gives_the_documented_figures(tmp_path: Path) -> None:
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


def readme_dpo_table() -> dict[str, list[float]]:
    """The guide's held-out DPO table (Preference training): metric -> steps 0, 5 ... 20."""
    rows = re.findall(r"^\| (eval/dpo/\w+) \|(.*)\|$", DPO_GUIDE.read_text(), re.M)
    assert rows, "docs/sft-dpo-distill.md's DPO table is not where this test reads it"
    return {name: [float(cell) for cell in cells.split("|")] for name, cells in rows}


@pytest.mark.slow
def test_the_dpo_example_learns_as_the_guide_says(tmp_path: Path) -> None:
    """The built-in DPO example: on the hardware the figures were measured on, every cell of
    the table; elsewhere the claims, not the digits: the policy starts at the reference, and
    the held-out margin, accuracy and rewards move as stated."""
    from grpo.training.recipes.dpo.config import DpoConfig
    from grpo.training.recipes.dpo.recipe import dpo

    table = readme_dpo_table()
    data = ROOT / "examples" / "dpo_arithmetic.jsonl"
    config = DpoConfig(data=str(data), run_dir=str(tmp_path / "dpo"), steps=20)
    result = dpo(config, echo=lambda _line: None, progress=False)
    rows = [row for row in read_metrics(result.run_dir) if "eval/dpo/loss" in row]
    assert [row["step"] for row in rows] == [0, 5, 10, 15, 20]
    if measured_on_this_hardware():
        measured = {name: [round(row[name], 4) for row in rows] for name in table}
        stated = {name: list(cells) for name, cells in table.items()}
        # but the step-0 accuracy: a coin toss over |h| < 1e-4 ties, which the batching of
        # the reference's concurrent requests can flip (the guide says so)
        measured["eval/dpo/accuracy"][0] = stated["eval/dpo/accuracy"][0]
        assert measured == stated
    first, last = rows[0], rows[-1]
    assert round(first["eval/dpo/loss"], 4) == table["eval/dpo/loss"][0] == 0.6931
    assert last["eval/dpo/margin"] > table["eval/dpo/margin"][-1] / 2 > 0
    assert last["eval/dpo/accuracy"] > 0.5 and table["eval/dpo/accuracy"][-1] > 0.5
    assert last["eval/dpo/chosen_reward"] > 0 > last["eval/dpo/rejected_reward"]
    assert last["eval/dpo/loss"] < first["eval/dpo/loss"]
