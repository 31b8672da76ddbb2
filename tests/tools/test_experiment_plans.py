"""Large experiment plans warn before planning and show progress (docs/RELIABILITY.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.tools.experiments import report
from grpo.tools.experiments.compare import compare_specs
from tests.runs import TINY


def test_a_large_dry_run_warns_first_and_shows_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "LARGE_PLAN", 2)
    specs = compare_specs(["ppo", "cispo", "importance_sampling"], range(1), dict(TINY), tmp_path)
    lines: list[str] = []
    progress: list[str] = []
    report.dry_run_specs(specs, echo=lines.append, progress=progress.append)
    assert progress[0].startswith("warning: a dry run of 3 runs (more than 2)")
    assert [line.split(":")[0] for line in progress[1:]] == [
        "checking run 1/3",
        "checking run 2/3",
        "checking run 3/3",
    ]
    assert lines[0].startswith("dry run of 3 run(s)")
