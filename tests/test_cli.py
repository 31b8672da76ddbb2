"""The `grpo` command line: help, flag parsing, TOML precedence, bad input, SIGINT and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.cli import build_parser, main
from grpo.config import TrainConfig
from grpo.flags import config_from_args
from grpo.logging import read_metrics

TINY_FLAGS = ["--batch-size", "2", "--group-size", "3", "--max-tokens", "24", "--eval-every", "0", "--concurrency", "4", "--num-substeps", "1"]


def test_help_shows_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--base-model", "--lora-rank", "--steps", "--all-data", "--batch-size", "--group-size", "--max-tokens",
                 "--temperature", "--top-p", "--seed", "--learning-rate", "--beta1", "--beta2", "--loss-fn",
                 "--cispo-clip-low-threshold", "--cispo-clip-high-threshold", "--swanlab-mode", "--swanlab-project",
                 "--backend", "--dataset", "--loss-config", "--custom-loss", "--reduction", "--advantage", "--kl-coef",
                 "--eval-every", "--save-every", "--resume", "--run-dir", "--concurrency", "--max-steps-off-policy",
                 "--num-substeps", "--epochs", "--config"):
        assert flag in text, flag
    assert "(default: 'importance_sampling')" in text and "(default: 0.0002)" in text


def test_flags_override_the_toml_file_which_overrides_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlearning-rate = 0.001\nloss_fn = "ppo"\nloss_config = ["clip_high_threshold=1.3"]\n')
    args = build_parser().parse_args(["train", "--config", str(toml), "--steps", "3", "--custom-loss"])
    config, resume = config_from_args(args)
    assert (config.steps, config.learning_rate, config.loss_config, config.custom_loss, resume) == (3, 0.001, ("clip_high_threshold=1.3",), True, False)
    assert config.group_size == TrainConfig().group_size


def test_unknown_key_in_toml_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("stepz = 3\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "stepz" in capsys.readouterr().err


def test_bad_flag_value_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--loss-fn", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--loss-fn" in capsys.readouterr().err
    assert main(["train", "--swanlab-mode", "cloud"]) == 2
    assert "--swanlab-mode 'cloud' is not one of online, offline, disabled" in capsys.readouterr().err


def test_sigint_mid_run_leaves_resumable_checkpoint_and_complete_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "grpo", "train", *TINY_FLAGS, "--steps", "400", "--run-dir", str(run_dir)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(run_dir / "metrics.jsonl")) < 2:
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "--resume" in err
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, checkpoint["step"] + 1))
    # Resume and finish (fewer total steps than first asked, to stay quick).
    target = checkpoint["step"] + 1
    assert main(["train", "--resume", str(run_dir), "--steps", str(target)]) == 0
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, target + 1))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == target


def test_eval_reports_accuracy_and_pass_at_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_FLAGS, "--steps", "1", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run_dir), "--limit", "6", "--samples", "4", "--temperature", "1.0"]) == 0
    out = capsys.readouterr().out
    for key in ("reward", "pass@1", "pass@2", "pass@4"):
        assert f"  {key}:" in out
    assert main(["eval", "--limit", "6"]) == 0
    assert "base model" in capsys.readouterr().out
