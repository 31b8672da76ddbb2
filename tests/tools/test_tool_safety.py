"""The user tools never overwrite or delete what they don't own, and never echo raw control text.

Each test is a case of docs/RELIABILITY.md ("The user tools"): a hostile but ordinary use
of `grpo show`, `grpo checkpoints`, `grpo export`, `grpo plot`, `--dataset` or `grpo train`.
Runs and checkpoints are built from files (no training), so every case takes well under a
second except the `grpo train` pre-flight one.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from grpo.cli import main
from grpo.tasks import data
from grpo.tools.paths import terminal_safe
from grpo.training.run import run_files

RUN_ID = "run-0"
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\r\u202eevil <script>alert(1)</script> 你好 é"


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def _adapter(directory: Path, *, kind: str = "sampler") -> Path:
    """A checkpoint directory like the local backend's: LoRA safetensors + configs."""
    directory.mkdir(parents=True)
    save_file(
        {
            "base_model.model.q_proj.lora_A.weight": np.zeros((4, 8), np.float32),
            "base_model.model.q_proj.lora_B.weight": np.zeros((8, 4), np.float32),
        },
        str(directory / "adapter_model.safetensors"),
    )
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (directory / "grpo_local.json").write_text(
        json.dumps(
            {"format": 1, "kind": kind, "base_model": "tiny", "lora_rank": 4, "created_unix": 1.0}
        )
    )
    return directory


def _run(run_dir: Path, *, completion: str = "42") -> Path:
    """A finished run directory: config, metrics, rollouts, a state checkpoint, final weights."""
    backend = run_dir / "backend" / RUN_ID
    state = _adapter(backend / "weights" / "step-000001", kind="state")
    final = _adapter(backend / "sampler_weights" / "final")
    (run_dir / "config.json").write_text(json.dumps({"steps": 1}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    group = {
        "step": 1,
        "group": 0,
        "row": 3,
        "prompt": f"What is 40+2? {HOSTILE}",
        "gold": "42",
        "degenerate": False,
        "completions": [
            {
                "text": completion,
                "reward": 1.0,
                "components": {"correct": 1.0},
                "advantage": 0.5,
                "tokens": 2,
                "stop_reason": "stop",
            }
        ],
    }
    (run_dir / "rollouts.jsonl").write_text(json.dumps(group) + "\n")
    run_files.write_checkpoint(
        run_dir, run_files.Checkpoint(1, f"local://{state.resolve()}"), run_name="r"
    )
    run_files.write_json_atomic(
        run_dir / "summary.json", {"finished": True, "sampler_path": f"local://{final.resolve()}"}
    )
    return run_dir


# --- --out never overwrites what the tool does not own --------------------------------------


def test_show_html_refuses_the_runs_own_files_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_bytes()
    for extra in ([], ["--force"]):
        err = _fails(capsys, "show", str(run), "--html", str(run / "metrics.jsonl"), *extra)
        assert "--html" in err and "being read" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_show_html_refuses_an_existing_file_or_another_run_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = _run(tmp_path / "run"), _run(tmp_path / "other")
    page = tmp_path / "page.html"
    page.write_text("mine")
    assert "already exists" in _fails(capsys, "show", str(run), "--html", str(page))
    assert page.read_text() == "mine"
    inside = other / "page.html"
    assert "inside the run directory" in _fails(capsys, "show", str(run), "--html", str(inside))
    assert not inside.exists()
    assert main(["show", str(run), "--html", str(page), "--force"]) == 0
    assert page.read_text().startswith("<!doctype html>")


def test_download_never_writes_into_the_checkpoint_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    checkpoint = run / "backend" / RUN_ID / "weights" / "step-000001"
    weights = (checkpoint / "adapter_model.safetensors").read_bytes()
    out = checkpoint / "adapter_model.safetensors"
    for extra in ([], ["--force"]):
        err = _fails(
            capsys,
            *("checkpoints", "download", f"local://{checkpoint.resolve()}", "--out", str(out)),
            *("--root", str(run / "backend"), *extra),
        )
        assert "--out" in err and "being read" in err
    assert out.read_bytes() == weights


def test_export_and_plot_refuse_an_existing_out_or_one_inside_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    assert "being read" in _fails(capsys, "export", str(run), "--out", str(run / "adapter"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep")
    assert "already exists" in _fails(capsys, "export", str(run), "--out", str(taken))
    assert main(["export", str(run), "--out", str(taken), "--force"]) == 0
    assert (taken / "notes.txt").read_text() == "keep"
    png = tmp_path / "plot.png"
    png.write_text("not mine")
    assert main(["plot", str(run), "--out", str(png)]) == 2
    assert "--out" in capsys.readouterr().err and png.read_text() == "not mine"


# --- export checks what it copies ------------------------------------------------------------


def test_export_of_weights_replaced_by_a_tar_says_it_found_a_tar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = _adapter(tmp_path / "checkpoint")
    archive = tmp_path / "archive.tar"
    with tarfile.open(archive, "w") as opened:
        opened.add(checkpoint / "adapter_config.json", arcname="adapter_config.json")
    shutil.copyfile(archive, checkpoint / "adapter_model.safetensors")
    err = _fails(capsys, "export", str(checkpoint), "--out", str(tmp_path / "out"))
    assert "not a safetensors file" in err and "tar archive" in err
    assert not (tmp_path / "out").exists()


# --- cleanup and delete act on one store -----------------------------------------------------


def test_cleanup_does_not_touch_a_cp_r_backup_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _run(tmp_path / "runs" / "a")
    shutil.copytree(tmp_path / "runs" / "a", tmp_path / "runs" / "a-backup")
    backup = tmp_path / "runs" / "a-backup" / "backend" / RUN_ID / "sampler_weights" / "final"
    err = _fails(capsys, "checkpoints", "cleanup", RUN_ID, "--all-samplers")
    assert "2 stores" in err and "--root" in err
    assert (backup / "adapter_model.safetensors").is_file()
    own = str(tmp_path / "runs" / "a" / "backend")
    assert main(["checkpoints", "cleanup", RUN_ID, "--all-samplers", "--root", own]) == 0
    assert "deleted 1 sampler checkpoint(s)" in capsys.readouterr().out
    assert (backup / "adapter_model.safetensors").is_file()


def test_deleting_the_checkpoint_a_run_resumes_from_needs_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    state = run / "backend" / RUN_ID / "weights" / "step-000001"
    root = str(run / "backend")
    argv = ["checkpoints", "delete", f"{RUN_ID}/weights/step-000001", "--root", root]
    err = _fails(capsys, *argv)
    assert "resumes from" in err and err.rstrip().endswith("can then not resume from it)")
    assert state.is_dir()
    assert main([*argv, "--force"]) == 0
    assert not state.exists()


# --- records relative to the run --------------------------------------------------------------


def test_a_moved_or_copied_finished_run_exports_its_own_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _run(tmp_path / "original")
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    final = "backend/run-0/sampler_weights/final"
    assert run_files.eval_weights_path(copy) == f"local://{(copy / final).resolve()}"
    moved = tmp_path / "moved"
    original.rename(moved)
    assert run_files.eval_weights_path(moved) == f"local://{(moved / final).resolve()}"
    assert main(["export", str(moved), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == (
        moved / final / "adapter_model.safetensors"
    ).read_bytes()


# --- control characters ------------------------------------------------------------------------


def test_terminal_safe_escapes_controls_and_keeps_printable_unicode() -> None:
    assert terminal_safe("a\x1b[31mb\r\n\tc\x9b 你好 é 🙂\u202e") == (
        "a\\x1b[31mb\\r\n\tc\\x9b 你好 é 🙂\\u202e"
    )


def test_show_escapes_control_characters_in_the_terminal_and_in_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run", completion=HOSTILE)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\x07" not in out
    assert "\\x1b[31mred" in out and "你好 é" in out
    page = tmp_path / "page.html"
    assert main(["show", str(run), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "\x1b" not in text and "<script>alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "你好 é" in text


# --- --dataset and the run directory's lock ----------------------------------------------------


def test_a_missing_path_like_dataset_says_no_such_file_before_any_hub_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(data.datasets, "load_dataset", no_hub)
    for source in ("mydata/train.jsonl", "./data/x", "~/nope/train.csv", "/no/such/dir"):
        with pytest.raises(FileNotFoundError, match="no such file") as raised:
            data.load_problems(source, "train")
        assert repr(source) in str(raised.value)


def test_a_failed_preflight_leaves_no_run_directory_or_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    err = _fails(capsys, "train", "--dataset", "missing.jsonl", "--steps", "1")
    assert "no such file" in err
    assert sorted(path.name for path in tmp_path.rglob("*")) == []
