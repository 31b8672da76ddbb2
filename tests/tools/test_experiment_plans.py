"""Experiment plans: large ones warn (or are refused) before planning, show progress, share
their problems, and the dry run checks what the real run checks (docs/RELIABILITY.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from grpo.tasks.data import ARITHMETIC_SPLIT_SIZES
from grpo.tools.experiments import report, sweep
from grpo.tools.experiments.compare import compare_specs
from grpo.tools.experiments.sweep import add_sweep_arguments
from grpo.training.recipes.grpo import plan
from grpo.training.rollouts import problems as rollouts
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


# --- sweep: the size first, a bound, shared planning; the dry run checks what the run checks ---

BASE = "[base]\nsteps = 2\nbatch_size = 2\ngroup_size = 4\nmax_tokens = 24\neval_every = 0\n"


def _sweep_args(path: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    return parser.parse_args([str(path), "--out", str(out), *extra])


def _values(count: int, start: float, step: float) -> str:
    return "[" + ", ".join(f"{start + step * i:.6g}" for i in range(count)) + "]"


def test_a_grid_beyond_max_runs_is_refused_before_any_planning_naming_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_planning(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a refused plan must not be planned")

    monkeypatch.setattr(plan, "plan_experiment", no_planning)
    monkeypatch.setattr(sweep, "grid_configs", no_planning)  # not even its configurations
    path = tmp_path / "big.toml"
    path.write_text(
        BASE + "[grid]\n"
        f"learning_rate = {_values(100, 1e-5, 1e-6)}\n"
        f"temperature = {_values(100, 0.5, 0.01)}\n"
    )
    assert sweep.run_sweep(_sweep_args(path, tmp_path / "out", "--dry-run")) == 2
    err = capsys.readouterr().err
    assert "100 x 100 = 10,000 configurations x 1 seed(s) = 10,000 runs" in err
    assert "more than --max-runs 1,000" in err and "pass --max-runs 10000" in err
    assert not (tmp_path / "out").exists()


def test_a_moderate_grid_says_its_size_first_then_plans_with_progress_sharing_its_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = []
    build_prompt_tokens = rollouts.build_prompt_tokens

    def counted(tokenizer: object, question: str, **kwargs: object) -> object:
        prompts.append(question)
        return build_prompt_tokens(tokenizer, question, **kwargs)

    monkeypatch.setattr(rollouts, "build_prompt_tokens", counted)
    path = tmp_path / "mid.toml"
    path.write_text(BASE + "[grid]\nlearning_rate = [1e-5, 2e-5, 3e-5]\ntemperature = [0.6, 0.8]\n")
    assert sweep.run_sweep(_sweep_args(path, tmp_path / "out", "--dry-run")) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0] == f"sweep {path}: 3 x 2 = 6 configurations x 1 seed(s) = 6 runs"
    assert err[1].startswith("checking run 1/6") and err[-1].startswith("checking run 6/6")
    assert captured.out.startswith("dry run of 6 run(s): every check passed")
    # The six runs differ only in flags that change no prompt: their prompts are built once.
    assert len(prompts) == ARITHMETIC_SPLIT_SIZES["train"]


def test_max_runs_lets_a_large_plan_through(tmp_path: Path) -> None:
    path = tmp_path / "wide.toml"
    grid = f"[grid]\nlearning_rate = {_values(30, 1e-5, 1e-6)}\n"
    path.write_text("seeds = [0, 1]\n" + BASE + grid)
    with pytest.raises(ValueError, match=r"30 configurations x 2 seed\(s\) = 60 runs, more"):
        sweep.load_sweep(path, max_runs=59)
    wide = sweep.load_sweep(path, max_runs=60)
    assert (len(wide.configs), len(wide.seeds)) == (30, 2)


@pytest.mark.parametrize(
    ("names", "extra", "message"),
    [
        (
            ("a/b", "a b"),
            (),
            "the configurations 'a/b' and 'a b' (seed 0) would share the run directory",
        ),
        (("x", "y"), ("--last-steps", "0"), "--last-steps must be >= 1, got 0"),
        (("x", "y"), ("--jobs", "0"), "--jobs must be >= 1, got 0"),
    ],
)
def test_the_dry_run_refuses_what_the_real_sweep_refuses_with_the_same_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    names: tuple[str, str],
    extra: tuple[str, ...],
    message: str,
) -> None:
    path = tmp_path / "named.toml"
    path.write_text(BASE + "".join(f'[[runs]]\nname = "{name}"\n' for name in names))
    out = tmp_path / "out"
    errors = []
    for mode in (("--dry-run",), ()):
        trainer = [sys.executable, "-c", "raise SystemExit('no trainer may start')"]
        assert sweep.run_sweep(_sweep_args(path, out, *mode, *extra), train_command=trainer) == 2
        errors.append(capsys.readouterr().err)
    assert message in errors[0], errors[0]
    assert errors[0].splitlines()[-1] == errors[1].splitlines()[-1]
    assert not out.exists()


def test_the_dry_run_refuses_a_run_directory_made_with_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.toml"
    path.write_text(BASE + '[[runs]]\nname = "only"\n')
    run_dir = tmp_path / "out" / "only-seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"steps": 9}))
    assert sweep.run_sweep(_sweep_args(path, tmp_path / "out", "--dry-run")) == 2
    assert "steps: 9 there, 2 requested" in capsys.readouterr().err
