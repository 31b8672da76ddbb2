"""`grpo runs`, `grpo checkpoints` and `grpo export` through pytrio's RestClient on `grpo serve`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from grpo.cli import main
from grpo.training.settings.config import TrainConfig
from tests import runs as tiny_runs

TINY = {**tiny_runs.TINY, "save_every": 1, "learning_rate": 5e-3, "backend": "pytrio"}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_runs_checkpoints_and_export_through_the_rest_client(
    served: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    tiny_runs.quiet_train(TrainConfig(**TINY, run_dir=str(run_dir)))
    summary = json.loads((run_dir / "summary.json").read_text())
    runs = _cli(capsys, "runs", "--backend", "pytrio")
    assert "grpo/tiny-qwen3-bpe" in runs
    listed = _cli(capsys, "checkpoints", "list", "--backend", "pytrio")
    assert summary["sampler_path"] in listed and "checkpoint(s)," in listed
    archive = tmp_path / "final.tar"
    _cli(
        capsys,
        "checkpoints",
        "download",
        summary["sampler_path"],
        "--backend",
        "pytrio",
        "--out",
        str(archive),
    )
    _cli(capsys, "export", str(archive), "--out", str(tmp_path / "adapter"))
    served_copies = sorted((served.state.registry.root).rglob("adapter_model.safetensors"))
    exported = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert any(copy.read_bytes() == exported for copy in served_copies)
    _cli(capsys, "checkpoints", "delete", summary["sampler_path"], "--backend", "pytrio")
    assert summary["sampler_path"] not in _cli(capsys, "checkpoints", "list", "--backend", "pytrio")
