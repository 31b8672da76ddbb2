"""Resume when the recorded checkpoint is gone; summary paths that follow a moved run."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from grpo.cli import describe_error
from grpo.training.recipes.grpo.run import RunStopped, train
from grpo.training.run.run_files import eval_weights_path, read_checkpoint, read_metrics
from grpo.training.settings.config import ConfigError
from tests.invariance import assert_same_rows
from tests.runs import comparable, quiet_train, tiny_config


def _stop_after(step: int):
    def echo(line: str) -> None:
        if line.startswith(f"step {step}/"):
            os.kill(os.getpid(), signal.SIGINT)

    return echo


def test_resume_falls_back_to_the_newest_intact_checkpoint_when_the_recorded_one_is_gone(
    tmp_path: Path,
) -> None:
    config = tiny_config(tmp_path, steps=3, save_every=1)
    with pytest.raises(RunStopped):
        train(config, echo=_stop_after(2), progress=False)
    recorded = read_checkpoint(tmp_path / "run")
    assert recorded is not None and recorded.step == 2
    shutil.rmtree(recorded.state_path.removeprefix("local://"))
    notes: list[str] = []
    train(config, resume=True, echo=notes.append, progress=False)
    assert any("resuming from step 1, the newest intact checkpoint" in note for note in notes)
    whole = quiet_train(tiny_config(tmp_path, "whole", steps=3, save_every=1))
    assert_same_rows(
        comparable(read_metrics(tmp_path / "run")), comparable(read_metrics(whole.run_dir))
    )


def test_the_resume_error_keeps_its_fix_through_the_cli_trimming(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=2, save_every=1)
    with pytest.raises(RunStopped):
        train(config, echo=_stop_after(1), progress=False)
    shutil.rmtree(tmp_path / "run" / "backend")
    with pytest.raises(ConfigError) as error:
        quiet_train(config, resume=True)
    message, code = describe_error(error.value)
    assert code == 2
    assert "Restore it" in message and message.endswith("to rerun from the start")


def test_a_moved_finished_run_points_at_its_own_final_weights(tmp_path: Path) -> None:
    quiet_train(tiny_config(tmp_path, "before", steps=1))
    recorded = json.loads((tmp_path / "before" / "summary.json").read_text())
    assert recorded["sampler_scheme"] == "local://"
    assert not Path(recorded["sampler_path"]).is_absolute()
    (tmp_path / "before").rename(tmp_path / "after")
    path = Path(eval_weights_path(tmp_path / "after").removeprefix("local://"))
    assert path.is_relative_to(tmp_path / "after") and path.is_dir()
