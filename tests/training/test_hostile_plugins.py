"""Hostile reward plugins: hangs, timeouts, writes into `row`, SystemExit (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo.core.rewards import RewardInput
from grpo.rewards import RewardError, load_rewards
from grpo.rewards.calls import uses_processes
from grpo.rewards.scores import score_completions
from grpo.training.recipes.grpo.run import RunStopped
from grpo.training.run.run_files import read_checkpoint, read_metrics
from tests.invariance import assert_same_rows
from tests.runs import TINY, comparable, quiet_train, tiny_config

PLUGINS = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    def _calls():
        # One byte per call in a shared file: its size is the run's call count, whichever
        # worker process makes the call.
        path = Path(os.environ["PLUGIN_COUNTER"])
        with path.open("ab") as counter:
            counter.write(b"x")
        return path.stat().st_size

    def hangs_after_one_step(completion, row):
        if _calls() > int(os.environ.get("PLUGIN_HANG_AFTER", "1000000000")):
            Path(os.environ["PLUGIN_COUNTER"] + ".hanging").touch()
            while True:
                time.sleep(1)
        return float(len(completion) % 3)

    def sleeps(completion, row):
        time.sleep(30)
        return 1.0

    def writes_row(completion, row):
        seen = row.get("seen", 0)
        row["seen"] = seen + 1
        row["question"] = row["question"] + " (graded)"
        return float(seen) + len(completion) % 2

    def exits_after_one_step(completion, row):
        if _calls() > 8:
            sys.exit(0)
        return float(len(completion) % 2)
    """
)


@pytest.fixture()
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "plugins.py"
    path.write_text(PLUGINS)
    monkeypatch.setenv("PLUGIN_COUNTER", str(tmp_path / "calls"))
    return path


def _sample(index: int = 0) -> RewardInput:
    return RewardInput(
        index=index, gold="1", num_tokens=3, max_tokens=8, stop_reason="stop", overlong_buffer=2
    )


def test_only_plugins_under_a_timeout_run_in_worker_processes(plugins: Path) -> None:
    assert not uses_processes(load_rewards(()), timeout=60.0)
    assert not uses_processes(load_rewards(("grpo.rewards:math_verify",)), timeout=60.0)
    assert uses_processes(load_rewards((f"{plugins}:sleeps",)), timeout=60.0)
    assert not uses_processes(load_rewards((f"{plugins}:sleeps",)), timeout=0.0)


def test_a_reward_past_the_timeout_stops_naming_reward_row_and_timeout(plugins: Path) -> None:
    rewards = load_rewards((f"{plugins}:sleeps",))
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"sleeps.*--reward-timeout 1s on row 7"):
        score_completions(rewards, [("a", {}, _sample(7))], [1], timeout=1.0)
    assert time.monotonic() - start < 20


def test_a_reward_past_the_timeout_scores_zero_under_reward_errors_zero(plugins: Path) -> None:
    rewards = load_rewards((f"{plugins}:sleeps",))
    items = [("a", {}, _sample(0)), ("b", {}, _sample(1))]
    scores = score_completions(rewards, items, [2], on_error="zero", timeout=1.0, workers=2)
    assert scores.errors == 2
    assert scores.totals_P[0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("timeout", [60.0, 0.0], ids=["worker-process", "this-process"])
def test_a_reward_never_sees_its_own_writes_into_row(plugins: Path, timeout: float) -> None:
    rewards = load_rewards((f"{plugins}:writes_row",))
    row = {"question": "q"}
    items = [("ab", row, _sample(0)), ("ab", row, _sample(0))]
    first = score_completions(rewards, items, [2], timeout=timeout)
    again = score_completions(rewards, items, [2], timeout=timeout)
    assert first.totals_P[0].tolist() == again.totals_P[0].tolist() == [0.0, 0.0]
    assert row == {"question": "q"}


def test_a_reward_writing_into_row_resumes_to_the_same_metrics(
    tmp_path: Path, plugins: Path
) -> None:
    flags = {"reward": (f"{plugins}:writes_row",), "steps": 3, "batch_size": 1}
    whole = quiet_train(tiny_config(tmp_path, "whole", **flags))
    quiet_train(tiny_config(tmp_path, "split", **{**flags, "steps": 1}))
    quiet_train(tiny_config(tmp_path, "split", **flags), resume=True)
    assert_same_rows(
        comparable(read_metrics(tmp_path / "split")), comparable(read_metrics(whole.run_dir))
    )


@pytest.mark.parametrize("timeout", [60.0, 0.0], ids=["worker-process", "this-process"])
def test_sys_exit_in_a_reward_stops_the_run_with_a_checkpoint_naming_it(
    tmp_path: Path, plugins: Path, timeout: float
) -> None:
    config = tiny_config(
        tmp_path, reward=(f"{plugins}:exits_after_one_step",), steps=3, reward_timeout=timeout
    )
    with pytest.raises(RunStopped, match=r"exits_after_one_step' raised SystemExit\(0\)") as error:
        quiet_train(config)
    assert error.value.exit_code == 1
    checkpoint = read_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.step == 1


def test_sigterm_stops_a_run_whose_reward_hangs_in_two_workers_with_a_checkpoint(
    tmp_path: Path, plugins: Path
) -> None:
    run_dir = tmp_path / "run"
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in TINY.items()]
    command = [sys.executable, "-m", "grpo", "train", *flags, "--steps", "3"]
    command += ["--reward", f"{plugins}:hangs_after_one_step", "--reward-workers", "2"]
    env = {**os.environ, "PLUGIN_HANG_AFTER": str(TINY["batch_size"] * TINY["group_size"])}
    process = subprocess.Popen(
        [*command, "--run-dir", str(run_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        hanging = Path(os.environ["PLUGIN_COUNTER"] + ".hanging")
        while not hanging.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert hanging.exists(), process.communicate()
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, err
    assert json.loads((run_dir / "checkpoint.json").read_text())["step"] == 1
    assert _group_ends(process.pid, within_s=10), "a worker process was left behind"


def _group_ends(group: int, *, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)
    return False
