"""Fault injection: a short run killed or interrupted at many points, then resumed, logs
steps 0..n exactly once with the same numbers as the uninterrupted run (docs/RELIABILITY.md).

Each trial runs `grpo train` in a process of its own with GRPO_FAULT_POINT=<point>:<n>:<signal>
(grpo.training.run.faults.fault_point): the run signals itself at the n-th pass of that point: after
sampling, after an optimizer step, entering an evaluation, before a row is logged, or in
the middle of a checkpoint save (state saved, checkpoint.json not yet written). SIGINT2 is
a double Ctrl-C. Two more trials SIGKILL at seeded random times. The killed runs (and
the uninterrupted references) are forked from one warm interpreter (`tests.warm_grpo`), so
that each pays no start-up of its own.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from grpo.cli import main
from grpo.training.run import run_files
from grpo.training.run.faults import FAULT_ENV
from tests.invariance import assert_same_rows
from tests.warm_grpo import Finished, WarmGrpo

FLAGS = [
    "--steps",
    "4",
    "--batch-size",
    "2",
    "--group-size",
    "6",
    "--max-tokens",
    "24",
    "--eval-every",
    "2",
    "--eval-limit",
    "4",
    "--save-every",
    "2",
    "--concurrency",
    "4",
    "--num-substeps",
    "1",
    "--seed",
    "0",
]
# (fault, what, the steps logged and the checkpoint's step when the run stops there)
TRIALS = [
    ("sampled:1:SIGKILL", "killed after the baseline row, before any checkpoint", [0], None),
    ("optim:3:SIGKILL", "killed in the middle of step 3's update", [0, 1, 2], 2),
    ("eval:2:SIGINT2", "double Ctrl-C during the evaluation of step 2", [0, 1], None),
    ("save:1:SIGKILL", "killed during the checkpoint save of step 2", [0, 1, 2], None),
    ("log:3:SIGINT", "Ctrl-C while logging step 2: finishes the step, saves, exits", [0, 1, 2], 2),
    ("log:5:SIGKILL", "killed just before the last row is logged", [0, 1, 2, 3], 2),
    ("sampled:3:SIGINT2", "double Ctrl-C right after step 3 sampled", [0, 1, 2], 2),
]
TIMEOUT_S = 180
# Under --max-steps-off-policy 1 the checkpoint of step 2 holds step 3's rollouts, sampled
# on step 1's weights: resumed, the run must train on those, not sample them again.
OFF_POLICY_FLAGS = [*FLAGS, "--max-steps-off-policy", "1"]
OFF_POLICY_TRIALS = [TRIALS[1], TRIALS[4]]  # kill -9 mid-update, Ctrl-C: resume from step 2


def _train(warm: WarmGrpo, run_dir: Path, *extra: str, fault: str | None = None) -> Finished:
    """`grpo train EXTRA` as a process of its own (with the fault point `fault` set), to its end."""
    output = run_dir.parent / f"{run_dir.name}-train"
    env = {FAULT_ENV: fault} if fault else None
    return warm.run(["train", *extra], output, env, timeout=TIMEOUT_S)


def _wait_for_rows(warm: WarmGrpo, run_dir: Path, count: int) -> float:
    """Wait until the run has logged `count` complete rows; the time it happened."""
    path = run_dir / run_files.METRICS_FILE
    deadline = time.monotonic() + TIMEOUT_S
    while not (path.exists() and path.read_bytes().count(b"\n") >= count):
        assert warm.running(), f"the run exited before logging {count} rows"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return time.monotonic()


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {key: value for key, value in row.items() if not key.startswith("time/")}
        for row in run_files.read_metrics(run_dir)
    ]


# A resumed run's final LoRA weights equal the uninterrupted run's to this share of each
# tensor's norm (here they are bit-identical; the margin is for float sums that a thread
# count or CPU path may order differently). The metrics alone miss a resume that drops
# Adam's state: resumed at step 2 of 4 without it, the rows stay within METRIC_RTOL while
# lm_head's lora_A ends 0.013 off in norm (0.4% of its 3.3, four times this bound).
WEIGHTS_RTOL = 1e-3


class Reference(NamedTuple):
    """What an uninterrupted run leaves: its metrics rows and its final LoRA weights."""

    rows: list[dict[str, Any]]
    weights: dict[str, torch.Tensor]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors a finished run's final sampler was saved with."""
    path = run_files.eval_weights_path(run_dir).removeprefix("local://")
    return load_file(str(run_dir / path / "adapter_model.safetensors"))


def _assert_same_weights(run_dir: Path, expected: dict[str, torch.Tensor], what: str) -> None:
    """``run_dir``'s final weights equal `expected`, each tensor to WEIGHTS_RTOL of its norm."""
    actual = _final_weights(run_dir)
    assert actual.keys() == expected.keys(), what
    for name, tensor in expected.items():
        off = float((actual[name] - tensor).norm())
        assert off <= WEIGHTS_RTOL * float(tensor.norm()) + 1e-9, f"{what}: {name} off by {off}"


def _resume_until_done(run_dir: Path, flags: list[str] = FLAGS) -> None:
    """Resume (or, when the kill came before anything was written, restart) to the end.

    In this process, through the `grpo` entry point (`grpo.cli.main`): the killed run was a
    process of its own, and its resume reads only what that process left on disk; a fresh
    interpreter per resume would add only its start-up (torch's import) to each trial."""
    assert FAULT_ENV not in os.environ, "the resume would signal pytest itself"
    for _attempt in range(3):
        if run_files.run_status(run_dir) == run_files.FINISHED:
            return
        if run_files.run_status(run_dir) == run_files.NEW:
            argv = ["train", *flags, "--run-dir", str(run_dir)]
        else:
            argv = ["train", "--resume", str(run_dir)]
        assert main(argv) == 0, f"grpo {' '.join(argv)} failed (its stderr is above)"
    assert run_files.run_status(run_dir) == run_files.FINISHED


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, warm_grpo: WarmGrpo) -> Reference:
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    result = _train(warm_grpo, run_dir, *FLAGS, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    # Every step trains (seed 0 has no all-degenerate step), so a redone step that
    # started from the wrong weights would show in its loss and ratios.
    assert all(row["datums"] > 0 for row in rows[1:]), rows
    return Reference(rows, _final_weights(run_dir))


@pytest.fixture(scope="module")
def off_policy_reference(
    tmp_path_factory: pytest.TempPathFactory, warm_grpo: WarmGrpo
) -> Reference:
    run_dir = tmp_path_factory.mktemp("faults") / "off-policy"
    result = _train(warm_grpo, run_dir, *OFF_POLICY_FLAGS, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _rows(run_dir)
    assert [row["off_policy_steps"] for row in rows[1:]] == [0.0, 1.0, 1.0, 1.0], "test setup"
    assert not (run_dir / "ahead").exists() or not any((run_dir / "ahead").iterdir())
    return Reference(rows, _final_weights(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "what", "logged", "checkpoint_step"),
    OFF_POLICY_TRIALS,
    ids=[trial[0] for trial in OFF_POLICY_TRIALS],
)
def test_an_off_policy_run_resumes_on_the_rollouts_it_had_sampled_ahead(
    tmp_path: Path,
    warm_grpo: WarmGrpo,
    off_policy_reference: Reference,
    fault: str,
    what: str,
    logged: list[int],
    checkpoint_step: int,
) -> None:
    run_dir = tmp_path / "run"
    first = _train(warm_grpo, run_dir, *OFF_POLICY_FLAGS, "--run-dir", str(run_dir), fault=fault)
    assert first.returncode in (-signal.SIGKILL, 130), (what, first.stderr[-2000:])
    assert [row["step"] for row in run_files.read_metrics(run_dir)] == logged, what
    assert (run_dir / "ahead" / f"step-{checkpoint_step:06d}.json").is_file(), what
    _resume_until_done(run_dir, OFF_POLICY_FLAGS)
    assert_same_rows(_rows(run_dir), off_policy_reference.rows, what)
    _assert_same_weights(run_dir, off_policy_reference.weights, what)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "what", "logged", "checkpoint_step"), TRIALS, ids=[trial[0] for trial in TRIALS]
)
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(
    tmp_path: Path,
    warm_grpo: WarmGrpo,
    reference: Reference,
    fault: str,
    what: str,
    logged: list[int],
    checkpoint_step: int | None,
) -> None:
    run_dir = tmp_path / "run"
    first = _train(warm_grpo, run_dir, *FLAGS, "--run-dir", str(run_dir), fault=fault)
    expected_code = {"SIGKILL": -signal.SIGKILL, "SIGINT": 130, "SIGINT2": 130}[fault.split(":")[2]]
    assert first.returncode == expected_code, (what, first.returncode, first.stderr[-2000:])
    if "Traceback" in first.stderr:
        pytest.fail(f"{what}: a traceback reached the user:\n{first.stderr[-2000:]}")
    # The fault landed where it was meant to: the run stopped there, unfinished.
    assert run_files.run_status(run_dir) == run_files.UNFINISHED, what
    checkpoint = run_files.read_checkpoint(run_dir)
    stopped_at = (
        [row["step"] for row in run_files.read_metrics(run_dir)],
        None if checkpoint is None else checkpoint.step,
    )
    assert stopped_at == (logged, checkpoint_step), f"{what}: (rows, checkpoint) {stopped_at}"
    _resume_until_done(run_dir)
    assert_same_rows(_rows(run_dir), reference.rows, what)
    _assert_same_weights(run_dir, reference.weights, what)


@pytest.mark.slow
@pytest.mark.parametrize("trial", [0, 1])
def test_sigkill_at_a_random_time_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, warm_grpo: WarmGrpo, reference: Reference, trial: int
) -> None:
    run_dir = tmp_path / "run"
    pid = warm_grpo.start(["train", *FLAGS, "--run-dir", str(run_dir)], tmp_path / "train")
    # Kill at a seeded random time within one step's duration (measured on this run, so on
    # this machine's speed) after row k + 1 of 5: at least two rows remain, so it lands.
    rng = random.Random(trial)
    k = rng.choice([1, 2])
    row_k = _wait_for_rows(warm_grpo, run_dir, k)
    step_s = _wait_for_rows(warm_grpo, run_dir, k + 1) - row_k
    time.sleep(rng.uniform(0.0, 1.0) * step_s)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # already ended: the assertion below says so
        pass
    assert warm_grpo.wait(TIMEOUT_S) == -signal.SIGKILL, "the run ended before the kill"
    assert run_files.run_status(run_dir) == run_files.UNFINISHED
    _resume_until_done(run_dir)
    assert_same_rows(_rows(run_dir), reference.rows)
    _assert_same_weights(run_dir, reference.weights, "killed at a random time")
