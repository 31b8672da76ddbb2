"""No command writes over what it reads: an output that is, lies inside or holds an input
(a run directory, a checkpoint, a data or TOML file) is refused, `--force` or not, before any
work (`grpo.training.run.inputs.refuse_overlap`, docs/RELIABILITY.md "The user tools").

Runs and checkpoints are built from files (`_run`), so no case trains or loads a model: each
refusal comes before any of that, which is what these tests check.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.training.run.inputs import ReadPath, read_paths, refuse_overlap
from grpo.training.settings.fields import ConfigError
from tests.tools.test_tool_safety import RUN_ID, _fails, _run

ROOT = Path(__file__).resolve().parents[2]
REFUSED = "which is being read"


def _weights(run: Path) -> Path:
    return run / "backend" / RUN_ID / "sampler_weights" / "final"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_the_rule_refuses_equal_inside_and_holding_paths_through_symlinks(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    (tmp_path / "link").symlink_to(data)
    reads = read_paths("--data", str(data / "train.jsonl"))
    assert reads == [ReadPath(f"--data {data / 'train.jsonl'}", (data / "train.jsonl").resolve())]
    for out, relation in (
        (data / "train.jsonl", "is"),
        (tmp_path / "link" / "train.jsonl", "is"),
        (tmp_path / "link", "holds"),
        (tmp_path, "holds"),
    ):
        with pytest.raises(ConfigError, match=f"{relation} --data .*{REFUSED}.*choose another"):
            refuse_overlap(out, "--out", reads)
    refuse_overlap(tmp_path / "elsewhere", "--out", reads)  # a sibling is fine
    assert read_paths("--dataset", "arithmetic") == []  # names are no paths
    assert read_paths("--reward", "grpo.rewards:boxed_match") == []


def test_eval_never_writes_into_the_checkpoint_it_evaluates_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = _weights(_run(tmp_path / "run"))
    before = _snapshot(weights)
    (tmp_path / "link").symlink_to(weights)
    for out in (weights / "grpo_local.json", tmp_path / "link" / "grpo_local.json"):
        err = _fails(
            capsys, "eval", "--checkpoint", f"local://{weights}", "--out", str(out), "--force"
        )
        assert f"--out {out}" in err and "lies inside --checkpoint" in err and REFUSED in err
    # --run-dir: the run's weights may live outside it (a service's store): those count too.
    outside = tmp_path / "store" / "final"
    shutil.copytree(weights, outside)
    run = tmp_path / "run"
    (run / "summary.json").write_text(f'{{"sampler_path": "local://{outside}"}}')
    err = _fails(capsys, "eval", "--run-dir", str(run), "--out", str(outside / "x.json"), "--force")
    assert f"the weights of --run-dir {run}" in err
    assert _snapshot(weights) == before


def test_eval_never_writes_over_a_file_the_runs_config_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    fewshot = tmp_path / "fewshot.json"
    fewshot.write_text("[]")
    (run / "config.json").write_text(f'{{"steps": 1, "fewshot_file": "{fewshot}"}}')
    err = _fails(capsys, "eval", "--run-dir", str(run), "--out", str(fewshot), "--force")
    assert f"is the run {run}'s --fewshot-file" in err
    assert fewshot.read_text() == "[]"


def test_export_refuses_an_out_that_holds_its_source_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = _weights(_run(tmp_path / "run"))
    for out in (weights.parent, tmp_path):  # the parent of the checkpoint, of the whole run
        err = _fails(capsys, "export", f"local://{weights}", "--out", str(out), "--force")
        assert f"--out {out} holds SOURCE" in err and REFUSED in err
    assert not (weights.parent / "adapter_model.safetensors").exists()


def test_plot_never_writes_over_the_runs_it_reads_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_bytes()
    (tmp_path / "link").symlink_to(run)
    for out in (run / "metrics.jsonl", tmp_path / "link" / "metrics.jsonl"):
        assert main(["plot", str(run), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "lies inside RUN_DIR" in err and REFUSED in err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_train_sft_and_dpo_refuse_a_run_dir_over_their_inputs_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    before = _snapshot(run)
    (tmp_path / "link").symlink_to(run)
    for run_dir in (run / "next", tmp_path / "link" / "next", run):
        err = _fails(capsys, "train", "--init-from", str(run), "--run-dir", str(run_dir))
        assert "--init-from" in err and REFUSED in err
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "examples" / "sft_arithmetic.jsonl", data / "sft.jsonl")
    shutil.copy(ROOT / "examples" / "dpo_arithmetic.jsonl", data / "dpo.jsonl")
    config = tmp_path / "run.toml"
    config.write_text("steps = 1\n")
    for argv in (
        ["sft", "--data", str(data / "sft.jsonl"), "--run-dir", str(data)],
        ["dpo", "--data", str(data / "dpo.jsonl"), "--run-dir", str(tmp_path)],
        ["dpo", "--data", str(data / "dpo.jsonl"), "--ref", str(run), "--run-dir", str(run)],
        ["train", "--config", str(config), "--run-dir", str(tmp_path), "--dry-run"],
        ["distill", "--teacher", str(run), "--run-dir", str(_weights(run) / "x")],
    ):
        err = _fails(capsys, *argv)
        assert "--run-dir" in err and REFUSED in err, argv
    assert _snapshot(run) == before
    assert sorted(path.name for path in data.iterdir()) == ["dpo.jsonl", "sft.jsonl"]


def test_compare_and_sweep_refuse_an_out_that_holds_what_they_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(ROOT / "examples" / "sft_arithmetic.jsonl", tmp_path / "rows.jsonl")
    dataset = tmp_path / "rows.jsonl"
    argv = ["compare", "--dataset", str(dataset), "--out", str(tmp_path), "--dry-run"]
    assert main(argv) == 2
    assert f"--out {tmp_path} holds run" in capsys.readouterr().err
    sweep_file = tmp_path / "exp" / "sweep.toml"
    sweep_file.parent.mkdir()
    sweep_file.write_text('[grid]\nloss_fn = ["ppo"]\n')
    assert main(["sweep", str(sweep_file), "--out", str(sweep_file.parent), "--dry-run"]) == 2
    assert "holds SWEEP.toml" in capsys.readouterr().err


def test_make_preference_pairs_never_writes_into_the_model_it_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from grpo.backends.local.tiny import TINY_MODEL_DIR

    spec = importlib.util.spec_from_file_location(
        "make_preference_pairs", ROOT / "scripts" / "make_preference_pairs.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "model").symlink_to(TINY_MODEL_DIR)
    for out in (TINY_MODEL_DIR, tmp_path / "model" / "pairs.jsonl"):
        argv = ["make_preference_pairs.py", "--out", str(out), "--problems", "1", "--samples", "1"]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exited:
            script.main()
        assert exited.value.code == 2
        assert "the built-in model" in capsys.readouterr().err
    assert not (TINY_MODEL_DIR / "pairs.jsonl").exists()
