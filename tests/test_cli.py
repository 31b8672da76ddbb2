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
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig
from grpo.training.settings.flags import config_from_args

TINY_FLAGS = [
    "--batch-size",
    "2",
    "--group-size",
    "3",
    "--max-tokens",
    "24",
    "--eval-every",
    "0",
    "--concurrency",
    "4",
    "--num-substeps",
    "1",
]


def test_help_shows_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--base-model",
        "--lora-rank",
        "--steps",
        "--all-data",
        "--batch-size",
        "--group-size",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--learning-rate",
        "--beta1",
        "--beta2",
        "--loss-fn",
        "--cispo-clip-low-threshold",
        "--cispo-clip-high-threshold",
        "--swanlab-mode",
        "--swanlab-project",
        "--backend",
        "--dataset",
        "--loss-config",
        "--custom-loss",
        "--reduction",
        "--advantage",
        "--kl-coef",
        "--eval-every",
        "--save-every",
        "--resume",
        "--run-dir",
        "--concurrency",
        "--max-steps-off-policy",
        "--num-substeps",
        "--epochs",
        "--config",
    ):
        assert flag in text, flag
    assert "(default: 'importance_sampling')" in text and "(default: 0.0002)" in text


def test_flags_override_the_toml_file_which_overrides_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        'steps = 7\nlearning-rate = 0.001\nloss_fn = "ppo"\n'
        'loss_config = ["clip_high_threshold=1.3"]\n'
    )
    args = build_parser().parse_args(
        ["train", "--config", str(toml), "--steps", "3", "--custom-loss"]
    )
    config, resume = config_from_args(args)
    assert (config.steps, config.learning_rate, config.loss_config, config.custom_loss, resume) == (
        3,
        0.001,
        ("clip_high_threshold=1.3",),
        True,
        False,
    )
    assert config.group_size == TrainConfig().group_size


def test_unknown_key_in_toml_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("stepz = 3\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "stepz" in capsys.readouterr().err


def test_bad_flag_value_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["train", "--loss-fn", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--loss-fn" in capsys.readouterr().err
    assert main(["train", "--swanlab-mode", "cloud"]) == 2
    assert (
        "--swanlab-mode 'cloud' is not one of online, offline, disabled" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_sigint_mid_run_leaves_resumable_checkpoint_and_complete_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "grpo",
        "train",
        *TINY_FLAGS,
        "--steps",
        "400",
        "--run-dir",
        str(run_dir),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(run_dir)) < 2:
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "--resume" in err
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, checkpoint["step"] + 1))
    # Resume and finish (fewer total steps than first asked, to stay quick).
    target = checkpoint["step"] + 1
    assert main(["train", "--resume", str(run_dir), "--steps", str(target)]) == 0
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, target + 1))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == target


def test_eval_reports_avg_pass_and_cons_at_n(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_FLAGS, "--steps", "1", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--run-dir",
                str(run_dir),
                "--limit",
                "6",
                "--samples",
                "4",
                "--temperature",
                "1.0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for key in ("avg@4", "pass@1", "pass@2", "pass@4", "cons@4", "format_rate", "reward"):
        assert f"  {key} " in out
    assert main(["eval", "--limit", "6"]) == 0
    assert "base model" in capsys.readouterr().out


# --- every bad input ends in one line naming it, exit 2, no traceback ------------------------


def fails_cleanly(argv: list[str], capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    """Run `grpo argv` in-process: exit 2, each expected text in stderr, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-rank", "0"], "--lora-rank must be in [4, 64], got 0"),
        (["--eps", "0"], "--eps must be > 0, got 0.0"),
        (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
        (["--grad-clip-norm", "-1"], "--grad-clip-norm must be >= 0, got -1.0"),
        (["--learning-rate", "inf"], "--learning-rate must be a finite number, got inf"),
        (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
        (["--kl-coef", "nan"], "--kl-coef must be a finite number, got nan"),
        (["--seed", "-1"], "--seed must be in [0, 2147483647], got -1"),
        (["--run-name", "a/../../x"], "--run-name 'a/../../x' must be a plain name"),
        (["--num-substeps", "9"], "--num-substeps must be in [1, --batch-size=8], got 9"),
        (["--loss-config", "typo=1"], "unknown config key 'typo' for loss 'importance_sampling'"),
    ],
)
def test_bad_train_flags_exit_2_before_any_work(
    flags: list[str], message: str, tmp_path: Path, capsys
) -> None:
    fails_cleanly(["train", *flags, "--run-dir", str(tmp_path / "run")], capsys, message)
    assert not (tmp_path / "run").exists()


MISSING_USER_INPUTS = [
    (["--reward", "no_such_module_xyz:f"], "no module 'no_such_module_xyz'"),
    (["--fewshot-file", "no_such_shots.json"], "--fewshot-file 'no_such_shots.json' not found"),
]


def _no_service(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("a service client was made")


@pytest.mark.parametrize(("flags", "message"), MISSING_USER_INPUTS)
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_missing_reward_or_fewshot_file_exits_2_before_any_service_call(
    flags: list[str], message: str, dry_run: list[str], tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr("grpo.training.run.lifecycle.make_service_client", _no_service)
    fails_cleanly(["train", *flags, *dry_run, "--run-dir", str(tmp_path / "run")], capsys, message)


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        ({"reward": ["no_such_module_xyz:f"]}, "no module 'no_such_module_xyz'"),
        ({"fewshot_file": "no_such_shots.json"}, "--fewshot-file 'no_such_shots.json' not found"),
    ],
)
def test_eval_of_a_run_whose_reward_or_fewshot_file_is_gone_exits_2_naming_the_run(
    saved: dict[str, object], message: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr("grpo.backends.pytrio.make_service_client", _no_service)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "summary.json").write_text(json.dumps({"sampler_path": "local://weights"}))
    fails_cleanly(["eval", "--run-dir", str(tmp_path)], capsys, f"--run-dir {tmp_path}: ", message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'lora_rank = 8\nsteps = "abc"\n',
            "run.toml line 2: --steps must be an integer, got 'abc'",
        ),
        ("steps = 2.5\n", "run.toml line 1: --steps must be an integer, got 2.5"),
        ("temperature = true\n", "run.toml line 1: --temperature must be a number, got True"),
        (
            "steps = 3\nsteps_ = \n",
            "run.toml: not valid TOML: Invalid value (at line 2, column 10)",
        ),
        ("stepz = 3\n", "run.toml line 1: unknown train flag 'stepz' (--stepz)"),
    ],
)
def test_bad_toml_names_file_and_line(text: str, message: str, tmp_path: Path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    fails_cleanly(["train", "--config", str(toml)], capsys, message)


def test_missing_config_file_and_bad_resume_dirs(tmp_path: Path, capsys) -> None:
    fails_cleanly(
        ["train", "--config", str(tmp_path / "nope.toml")],
        capsys,
        f"--config file {tmp_path / 'nope.toml'} not found",
    )
    fails_cleanly(
        ["train", "--resume", str(tmp_path)],
        capsys,
        f"{tmp_path} is not a run directory (no config.json)",
    )
    (tmp_path / "config.json").write_text('{"steps": 3,\n "seed": }\n')
    fails_cleanly(
        ["train", "--resume", str(tmp_path)],
        capsys,
        "config.json line 2 column 10 is not valid JSON",
    )
    (tmp_path / "config.json").write_text('{"steps": 2.5}')
    fails_cleanly(
        ["train", "--resume", str(tmp_path)],
        capsys,
        "config.json: --steps must be an integer, got 2.5",
    )


def test_bad_dataset_files_name_the_file_and_line(tmp_path: Path, capsys) -> None:
    run = ["train", *TINY_FLAGS, "--run-dir", str(tmp_path / "run"), "--dataset"]
    fails_cleanly([*run, str(tmp_path / "nope.jsonl")], capsys, "nope.jsonl", "check the path")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails_cleanly([*run, str(empty)], capsys, f"data file {empty} is empty")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\nnot json\n")
    fails_cleanly(
        [*run, str(broken)], capsys, f"data file {broken} cannot be read: line 2 is not valid JSON"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["--max-tokens", "-5"], "--max-tokens must be >= 1, got -5"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--split", "val"], "--split 'val' is not one of train, test"),
        (["--backend", "cloud"], "--backend 'cloud' is not one of local, pytrio"),
    ],
)
def test_bad_eval_flags_exit_2(flags: list[str], message: str, capsys) -> None:
    fails_cleanly(["eval", *flags], capsys, message)


def test_eval_of_a_bogus_checkpoint_or_run_dir_or_model_says_what_to_give(
    tmp_path: Path, capsys
) -> None:
    fails_cleanly(
        ["eval", "--run-dir", str(tmp_path)], capsys, f"{tmp_path} is not a run directory"
    )
    fails_cleanly(
        ["eval", "--checkpoint", "bogus", "--limit", "2"],
        capsys,
        "--checkpoint bogus: neither sampler weights nor a training state",
    )
    fails_cleanly(
        ["eval", "--base-model", "nope/model", "--limit", "2"],
        capsys,
        "unknown base model 'nope/model'",
    )


def test_debug_flag_or_environment_shows_the_traceback(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["train", "--eps", "0", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("GRPO_DEBUG", "1")
    assert main(["train", "--eps", "0"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_full_disk_names_the_path_and_the_free_space(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import grpo.training.recipes.grpo.run

    target = tmp_path / "run" / "config.json"

    def full_disk(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(grpo.training.recipes.grpo.run, "train", full_disk)
    assert main(["train", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"no space left on the device writing {target}" in err and "MiB free there" in err
    assert "Traceback" not in err


def test_pytrio_without_a_key_says_how_to_log_in(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in [name for name in os.environ if "PYTRIO" in name or "TRIO_" in name]:
        monkeypatch.delenv(name)
    run = ["train", *TINY_FLAGS, "--backend", "pytrio", "--run-dir", str(tmp_path / "run")]
    fails_cleanly(run, capsys, "PyTRIO service unavailable", "trio login", "--backend local")
    fails_cleanly(["eval", "--backend", "pytrio", "--limit", "2"], capsys, "trio login")


def _help_entries(text: str) -> dict[str, str]:
    """Each option of a `--help` text (its first flag) and its whole entry, in one line."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif line.startswith("    ") and current is not None:
            entries[current] += " " + stripped
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["train", "distill", "sft", "dpo"])
def test_help_groups_its_flags_and_says_each_default_once(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    titles = {line[:-1] for line in text.splitlines() if line.endswith(":") and line[0] != " "}
    assert {"run", "data and task", "update", "evaluation and checkpoints", "service"} <= titles
    if command in ("train", "distill"):
        assert {"sampling", "loss", "KL and mismatch", "environments and tools"} <= titles
        assert {"judge", "teacher", "prices"} <= titles
    entries = _help_entries(text)
    twice = [flag for flag, entry in entries.items() if entry.count("(default") > 1]
    assert twice == [], f"defaults said twice: {twice}"


def test_train_help_lists_every_choice_and_says_what_a_reward_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "{center,standardize,rloo,batch_standardize}" in entries["--advantage"]
    assert "recompute}" in entries["--mismatch-correction"]
    assert "{k1,k2,k3}" in entries["--kl-estimator"]
    assert entries["--reward"].startswith("--reward MODULE:FUNCTION[=WEIGHT]")
    assert "KEY=VALUE" not in entries["--reward"]
    assert "(default: none)" in entries["--system-prompt"]


def test_serve_help_shows_the_port_default(capsys: pytest.CaptureFixture[str]) -> None:
    from grpo.serve.command import DEFAULT_PORT

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert f"default: {DEFAULT_PORT}" in entries["--port"]
    assert [flag for flag, entry in entries.items() if entry.count("(default") > 1] == []


def test_eval_help_lists_its_choices_and_says_each_default_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert entries["--backend"].startswith("--backend {local,pytrio,tinker}")
    assert entries["--split"].startswith("--split {train,test}")
    assert "(default: 32)" in entries["--concurrency"]
    assert [flag for flag, entry in entries.items() if entry.count("(default") > 1] == []
