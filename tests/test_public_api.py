"""The public Python API: `from grpo import TrainConfig, train, evaluate` (docs/python-api.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import grpo
from tests.runs import TINY


def test_import_grpo_and_its_public_names_load_no_torch():
    script = (
        "import sys, grpo\n"
        "from grpo import ConfigError, TrainConfig, evaluate\n"
        "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split() == []


def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error():
    from grpo.tools.evaluate import evaluate
    from grpo.training.settings.config import TrainConfig

    assert grpo.TrainConfig is TrainConfig and grpo.evaluate is evaluate
    for name in grpo.__all__:
        assert getattr(grpo, name) is not None and name in dir(grpo)
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        grpo.trian  # noqa: B018 - the access is the test


def test_train_then_evaluate_from_python_returns_the_metrics(tmp_path: Path):
    config = grpo.TrainConfig(**{**TINY, "run_dir": str(tmp_path / "nb")})
    result = grpo.train(config, echo=lambda _line: None, progress=False)
    assert isinstance(result, grpo.RunResult)
    assert result.steps == TINY["steps"] and result.run_dir == tmp_path / "nb"
    assert 0.0 <= result.final_metrics["reward"] <= 1.0
    lines: list[str] = []
    metrics = grpo.evaluate(result.run_dir, limit=4, samples=2, echo=lines.append)
    assert {"test/avg@2", "test/pass@1", "test/pass@2", "test/cons@2", "test/reward"} <= set(
        metrics
    )
    assert 0.0 <= metrics["test/pass@1"] <= metrics["test/pass@2"] <= 1.0
    assert "4 test problems, 2 sample(s) x 1 seed(s), temperature 0.0" in lines[-1]


def test_evaluate_rejects_bad_arguments_before_loading_anything(tmp_path: Path):
    with pytest.raises(grpo.ConfigError, match="--samples must be >= 1, got 0"):
        grpo.evaluate(samples=0)
    with pytest.raises(grpo.ConfigError, match="--split 'dev' is not one of train, test"):
        grpo.evaluate(split="dev")
    with pytest.raises(grpo.ConfigError, match="not both"):
        grpo.evaluate(tmp_path, checkpoint="x")


def _resolves(dotted: str) -> bool:
    """Whether ``grpo.a.b.name`` is a module, or an attribute of the longest module prefix."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_every_import_and_name_the_docs_show_exists() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    documents = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    readme = "\n".join(document.read_text(encoding="utf-8") for document in documents)
    names: set[str] = set()
    for module, imported in re.findall(r"^\s*from (grpo[\w.]*) import ([\w, ]+)", readme, re.M):
        names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
    names.update(re.findall(r"`(grpo(?:\.[A-Za-z_]\w*)+)", readme))
    modules_files = {name for name in names if name.endswith(".py")}  # a file: `grpo.py`
    missing = sorted(name for name in names - modules_files if not _resolves(name))
    assert not missing, f"README.md or docs/*.md name what does not exist: {missing}"
