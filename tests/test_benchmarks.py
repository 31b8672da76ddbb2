"""Every benchmark runs end to end in --quick mode and prints its table (no timing thresholds).

This is the CI step that keeps the benchmarks from rotting: `python -m pytest` runs each
benchmark's `main(["--quick"])` in-process (seconds each).
"""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import (
    datums,
    load,
    local,
    loop,
    losses,
    mismatch,
    peer,
    refactor_step,
    serve,
    step,
    tinker,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("benchmark", "expected"),
    [
        (
            losses,
            [
                "| importance_sampling | 256k |",
                "| gspo | 16k |",
                "loop/(cat+default)",
                "importance_sampling: compiled in",
                "targets",
            ],
        ),
        (datums, ["| pack_groups + batch_to_datums (loop) |", "checked equal"]),
        (loop, ["| sequential (concurrency=1) |", "| concurrent + max_steps_off_policy=1 |"]),
        (local, ["| 1 thread | 16 x 32"]),
        (
            mismatch,
            ["| float32 | 1 | 1 |", "| bfloat16 | 0.7 | 0.9 |", "forward / forward_backward"],
        ),
        (serve, ["| forward_backward_custom (8 datums) |", "| default config, 2 steps |"]),
        (load, ["| quiet | ", "| torch process + CPU hog | "]),
        (step, ["| trainer: forward (log-probs) |", "### unshared forward", "unshared / shared"]),
        (peer, ["| grpo (local backend) |"]),  # TRL's row only where trl is installed
        (tinker, ["| quiet | ", "through the SDK s/step"]),
    ],
    ids=[
        "losses",
        "datums",
        "loop",
        "local",
        "mismatch",
        "serve",
        "load",
        "step",
        "peer",
        "tinker",
    ],
)
def test_quick_benchmark_completes_and_prints_its_table(
    benchmark: object, expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert benchmark.main(["--quick"]) == 0  # type: ignore[attr-defined]
    output = capsys.readouterr().out
    assert "machine:" in output and "command: `python -m benchmarks." in output
    for fragment in expected:
        assert fragment in output, fragment


@pytest.mark.slow
def test_quick_refactor_step_runs_both_trees_and_compares_their_metrics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = subprocess.run(
        [
            "git",
            "-C",
            str(refactor_step.this_tree()),
            "cat-file",
            "-e",
            f"{refactor_step.BEFORE_REFACTOR}^{{commit}}",
        ],
        capture_output=True,
    )
    if found.returncode != 0:
        pytest.skip(f"this checkout lacks commit {refactor_step.BEFORE_REFACTOR} (shallow clone?)")
    assert refactor_step.main(["--quick"]) == 0
    output = capsys.readouterr().out
    assert "command: `python -m benchmarks.refactor_step --quick`" in output
    assert "| 1 | " in output and "now/before per round" in output
    assert "identical in every round: yes" in output
