"""`grpo compare` stopped by SIGTERM: its trainers get the signal and stop with a checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.training.run.run_files import UNFINISHED, read_checkpoint, read_metrics, run_status
from tests.runs import TINY


def _processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains `text` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in command and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_sigterm_to_compare_stops_both_trainers_with_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    flags = {**TINY, "steps": 400, "save_every": 0}
    command = [sys.executable, "-m", "grpo", "compare", "--loss-fn", "ppo", "cispo"]
    command += ["--seeds", "1", "--jobs", "2", "--out", str(out)]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in flags.items()]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = [out / "ppo-seed0", out / "cispo-seed0"]
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and process.poll() is None:
            if all(run.is_dir() and read_metrics(run) for run in runs):
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=90)
        left = _processes_naming(str(out))
    finally:
        if process.poll() is None:
            process.kill()
        for pid in _processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)
    assert process.returncode == 130, err
    assert "stopped by SIGTERM" in _out
    for run in runs:
        checkpoint = read_checkpoint(run)
        assert run_status(run) == UNFINISHED and checkpoint is not None and checkpoint.step >= 1
    assert left == [], "trainers left running"
