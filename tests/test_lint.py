"""The code passes the project's ruff configuration (pyproject.toml: line length 100).

ruff is a test dependency (`pip install -e ".[test]"`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["grpo", "tests", "benchmarks", "scripts", "examples"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ruff", *args, *PATHS]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check",), ("format", "--check")], ids=["check", "format"])
def test_ruff_passes(args: tuple[str, ...]) -> None:
    result = _ruff(*args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
