"""Env calls are bounded: a step that never returns, sys.exit in a step, an empty opening."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import pytest

from grpo.cli import main
from grpo.envs.base import EnvError, EnvTimeout, env_step, initial_messages

OPENING = [{"role": "user", "content": "hi"}]


class Hangs:
    def initial_observation(self):
        return OPENING

    def step(self, action_text):
        time.sleep(3600)


class Exits:
    def initial_observation(self):
        return OPENING

    def step(self, action_text):
        sys.exit(0)


class Silent:
    def initial_observation(self):
        return []


def test_a_step_that_never_returns_is_an_env_timeout_naming_the_env_and_the_turn() -> None:
    start = time.monotonic()
    with pytest.raises(EnvTimeout, match=r"env.step \(Hangs, turn 2\) did not return within "):
        env_step(Hangs(), "x", 2, timeout_s=0.5)
    assert time.monotonic() - start < 2


def test_sys_exit_in_a_step_is_an_env_error_not_the_end_of_the_run() -> None:
    with pytest.raises(EnvError, match=r"raised SystemExit: 0 \(Exits, turn 0\).*may not end"):
        env_step(Exits(), "x", 0, timeout_s=5)


def test_an_empty_opening_names_the_env() -> None:
    with pytest.raises(EnvError, match="initial_observation\\(\\) of Silent returned no messages"):
        initial_messages(Silent(), timeout_s=5)
    assert initial_messages(Hangs(), timeout_s=5) == tuple(OPENING)


def test_a_process_whose_pool_thread_waits_on_a_stuck_env_still_exits() -> None:
    # A rollout pool thread (not a daemon, joined at exit) waits on an env that never
    # returns, with no timeout; the main thread stops: the wait ends and the process exits.
    script = textwrap.dedent(
        """
        import time
        from grpo.envs.base import env_step
        from concurrent.futures import ThreadPoolExecutor
        class Hangs:
            def step(self, action_text):
                time.sleep(3600)
        pool = ThreadPoolExecutor(1)
        pool.submit(env_step, Hangs(), "x", 0, 0.0)
        time.sleep(0.3)
        raise SystemExit(130)
        """
    )
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
    assert result.returncode == 130
    assert time.monotonic() - start < 10


HANGING_ENV = """
import time

class Hangs:
    def __init__(self, task):
        self.task = task

    def initial_observation(self):
        return list(self.task.messages)

    def step(self, action_text):
        time.sleep(3600)


def make(task):
    return Hangs(task)
"""


def test_a_run_whose_env_hangs_stops_at_the_env_timeout_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hangs.py").write_text(HANGING_ENV)
    run_dir = tmp_path / "run"
    argv = ["train", "--env", f"{tmp_path / 'hangs.py'}:make", "--env-timeout", "1"]
    argv += ["--steps", "1", "--eval-every", "0", "--batch-size", "2", "--group-size", "2"]
    argv += ["--max-tokens", "8", "--swanlab-mode", "disabled", "--run-dir", str(run_dir)]
    start = time.monotonic()
    code = main(argv)
    assert code == 1
    assert time.monotonic() - start < 120
    err = capsys.readouterr().err
    assert "env.step (Hangs, turn 0) did not return within --env-timeout 1s" in err
    assert "Traceback" not in err
    assert json.loads((run_dir / "config.json").read_text())["env_timeout"] == 1.0


def test_an_env_reward_that_would_overflow_and_an_env_module_that_exits_are_refused(
    tmp_path: Path,
) -> None:
    from grpo.envs.base import as_step_result, load_env_factory

    with pytest.raises(EnvError, match=r"returned reward 1e\+308, beyond ±1e\+12"):
        as_step_result(([], 1e308, True), "env.step")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"exits.py failed: SystemExit: 3"):
        load_env_factory(f"{tmp_path / 'exits.py'}:make")


MARKED_HANG = """
import pathlib, time

class Hangs:
    def __init__(self, task):
        self.task = task

    def initial_observation(self):
        return list(self.task.messages)

    def step(self, action_text):
        pathlib.Path(__file__).with_name("stepping").touch()
        time.sleep(3600)


def make(task):
    return Hangs(task)
"""


def test_sigterm_stops_a_run_whose_env_never_returns_within_seconds(tmp_path: Path) -> None:
    import os
    import signal

    (tmp_path / "hangs.py").write_text(MARKED_HANG)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "grpo", "train", "--env", f"{tmp_path / 'hangs.py'}:make"]
    argv += ["--env-timeout", "0", "--steps", "2", "--eval-every", "0", "--batch-size", "2"]
    argv += ["--group-size", "2", "--max-tokens", "8", "--swanlab-mode", "disabled"]
    argv += ["--run-dir", str(run_dir)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stepping").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        sent = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert time.monotonic() - sent < 20
    assert "stopped by signal" in err and "grpo train --resume" in err
    assert "Traceback" not in err


FLAKY_ENV = """
import time


class Flaky:
    \"\"\"Even rows hang in step(); odd ones answer with their action's length parity.\"\"\"

    def __init__(self, task):
        self.task = task

    def initial_observation(self):
        return list(self.task.messages)

    def step(self, action_text):
        if self.task.index % 2 == 0:
            time.sleep(3600)
        return [], float(len(action_text) % 2), True


def make(task):
    return Flaky(task)
"""


def test_env_errors_zero_ends_a_timed_out_episode_with_reward_0_and_counts_it(
    tmp_path: Path,
) -> None:
    from grpo.training.run.run_files import read_metrics
    from tests.runs import quiet_train, tiny_config

    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    config = tiny_config(
        tmp_path,
        "zero",
        env=f"{tmp_path / 'flaky.py'}:make",
        env_timeout=0.5,
        env_errors="zero",
        steps=2,
        batch_size=4,
        group_size=2,
        max_tokens=8,
    )
    rows = read_metrics(quiet_train(config).run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # some tasks of each step hung: their episodes ended, scored 0, counted
        assert 0 < row["env/errors"] < 1, row
        assert row["rollout/frac_truncated"] < 1
    from grpo.training.recipes.grpo.run import RunStopped

    with pytest.raises(RunStopped, match="EnvTimeout"):  # the default stops the run instead
        quiet_train(attrs.evolve(config, run_dir=str(tmp_path / "stop"), env_errors="stop"))
