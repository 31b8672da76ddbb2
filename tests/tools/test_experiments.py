"""`grpo compare` and `grpo sweep`: planning, skip/resume, reports computed from the metrics files.

A fake trainer (a small script honouring the run-directory contract: config.json,
metrics.jsonl, summary.json, `--resume DIR`) stands in for `grpo train` so the tests are fast;
one end-to-end test runs the real trainer with tiny settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from grpo.core.evaluation import student_t_quantile
from grpo.tools.experiments.compare import add_compare_arguments, compare_specs, run_compare
from grpo.tools.experiments.report import experiment_figure
from grpo.tools.experiments.runner import MANAGED_FLAGS, execute_runs, normalize_overrides
from grpo.tools.experiments.stats import (
    RunStats,
    final_value,
    mean_std,
    on_policy_warning,
    read_run,
    separation,
    steps_per_second,
)
from grpo.tools.experiments.sweep import add_sweep_arguments, load_sweep, run_sweep
from grpo.training.settings.flags import explicit_flags, train_argv

# Writes a plausible run directory quickly. Reward of step s for a run:
# BASE[loss] + 0.01·seed + 0.02·s + 1000·learning_rate; ratios spread by FAKE_RATIO_SPREAD.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    BASE = {"importance_sampling": 0.1, "ppo": 0.2, "cispo": 0.3}
    argv = sys.argv[1:]
    with open(os.environ["FAKE_CALLS"], "a") as calls:
        calls.write(json.dumps(argv) + "\\n")

    def parse(argv):
        flags, index = {}, 0
        while index < len(argv):
            name = argv[index][2:].replace("-", "_")
            if name == "loss_config":
                flags.setdefault(name, []).append(argv[index + 1])
                index += 2
            elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                flags[name] = argv[index + 1]
                index += 2
            else:
                flags[name] = True
                index += 1
        return flags

    flags = parse(argv)
    resuming = "resume" in flags
    run_dir = Path(flags["resume"] if resuming else flags["run_dir"])
    if resuming:
        config = json.loads((run_dir / "config.json").read_text())
    else:
        config = {"loss_fn": "importance_sampling", "seed": 0, "steps": 3, "learning_rate": 0.0001}
        for name, value in flags.items():
            config[name] = value
        for name in ("seed", "steps"):
            config[name] = int(config[name])
        config["learning_rate"] = float(config["learning_rate"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config))
    loss, seed, steps = config["loss_fn"], config["seed"], config["steps"]
    spread = float(os.environ.get("FAKE_RATIO_SPREAD", "0.3"))
    metrics_path = run_dir / "metrics.jsonl"
    done = (
        [json.loads(line)["step"] for line in metrics_path.read_text().splitlines()]
        if metrics_path.exists()
        else []
    )
    crash = os.environ.get("FAKE_CRASH") == run_dir.name and not resuming

    def reward(step):
        return BASE.get(loss, 0.15) + 0.01 * seed + 0.02 * step + 1000 * config["learning_rate"]

    with metrics_path.open("a") as metrics:
        for step in range(max(done, default=0) + 1, steps + 1):
            clipped = 0.0 if loss == "importance_sampling" else spread * 0.1 * step
            row = {
                "step": step, "reward": reward(step), "frac_degenerate": 0.5 / step,
                "rollout/avg_gen_len": 10.0 + step, "loss": -0.1 * step, "time/step": 0.5,
                f"{loss}/clip_fraction": clipped, f"{loss}/clip_low_fraction": clipped / 2,
                f"{loss}/clip_high_fraction": clipped / 2, f"{loss}/ratio_mean": 1.0 + spread / 10,
                f"{loss}/ratio_min": 1.0 - spread * step / steps,
                f"{loss}/ratio_max": 1.0 + spread * step,
            }
            metrics.write(json.dumps(row) + "\\n")
            metrics.flush()
            if crash:
                sys.exit(3)
        test_reward = reward(steps) - 0.05
        metrics.write(json.dumps({"step": steps, "test/reward": test_reward}) + "\\n")
    summary = {
        "finished": True, "steps": steps, "wall_time_s": 0.5 * steps, "test/reward": test_reward
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    """
)


@pytest.fixture
def fake_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Path]:
    """(train_command running the fake trainer, the file where it records each call's argv)."""
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    calls = tmp_path / "calls.jsonl"
    calls.touch()
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.delenv("FAKE_CRASH", raising=False)
    monkeypatch.delenv("FAKE_RATIO_SPREAD", raising=False)
    return [sys.executable, str(script)], calls


def read_calls(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def compare_args(out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    return parser.parse_args(
        ["--loss-fn", "importance_sampling", "ppo", "--seeds", "2", "--out", str(out), *extra]
    )


def sweep_args(path: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    return parser.parse_args([str(path), "--out", str(out), *extra])


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_rewards_mean(run_dir: Path, last_steps: int) -> float:
    rewards = [row["reward"] for row in metric_rows(run_dir) if "reward" in row]
    return float(np.mean(rewards[-last_steps:]))


# --- flags ---------------------------------------------------------------------------------


def test_train_argv_renders_switches_sequences_and_values() -> None:
    overrides = {
        "steps": 4,
        "custom_loss": True,
        "loss_config": ("clip_high_threshold=1.28", "dual_clip=3"),
        "fewshot": False,
        "learning_rate": 3e-5,
    }
    assert train_argv(overrides) == [
        "--steps",
        "4",
        "--custom-loss",
        "--loss-config",
        "clip_high_threshold=1.28",
        "--loss-config",
        "dual_clip=3",
        "--no-fewshot",
        "--learning-rate",
        "3e-05",
    ]
    assert train_argv({"custom_loss": False, "fewshot": None}) == []


def test_normalize_overrides_turns_a_loss_config_table_into_key_value_strings() -> None:
    overrides = normalize_overrides(
        {"loss-config": {"clip_high_threshold": 1.28}, "learning_rate": 1}, where="f.toml"
    )
    assert overrides == {"loss_config": ("clip_high_threshold=1.28",), "learning_rate": 1}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stepz": 3}, r"f\.toml: unknown train flag 'stepz' \(--stepz\)"),
        ({"steps": "ten"}, r"f\.toml: --steps must be an integer, got 'ten'"),
        ({"custom_loss": 1}, r"f\.toml: --custom-loss must be true or false, got 1"),
        ({"backend": "cloud"}, r"f\.toml: --backend 'cloud' is not one of local, pytrio"),
        ({"seed": 1}, r"'seed' is set per run"),
        ({"run_dir": "x"}, r"'run_dir' is set per run"),
    ],
)
def test_normalize_overrides_rejects_bad_flags_naming_them(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_overrides(raw, where="f.toml")


def test_compare_arguments_pass_only_the_train_flags_given() -> None:
    args = compare_args(
        Path("out"), "--steps", "7", "--custom-loss", "--loss-config", "dual_clip=3"
    )
    flags = explicit_flags(args, exclude=MANAGED_FLAGS | {"loss_fn"})
    assert flags == {"steps": 7, "custom_loss": True, "loss_config": ["dual_clip=3"]}
    assert args.loss_fns == ["importance_sampling", "ppo"]


# --- statistics ----------------------------------------------------------------------------


def test_mean_std_is_the_mean_and_sample_std_of_present_values() -> None:
    stat = mean_std([1.0, None, 2.0, 4.0])
    assert stat.n == 3
    assert stat.mean == pytest.approx(7 / 3)
    assert stat.std == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
    assert mean_std([0.5]).std is None and mean_std([0.5]).format() == "0.500"
    assert mean_std([None]).format() == "–"


def _stats(
    loss_fn: str,
    clip_fraction: float | None,
    ratio_min: float | None,
    ratio_max: float | None,
    mismatch: float | None = None,
) -> RunStats:
    """A finished 3-step run's statistics; `mismatch` is its max |log ρ| (KL k3: a tenth)."""
    return RunStats(
        name=f"{loss_fn}-seed0",
        label=loss_fn,
        seed=0,
        loss_fn=loss_fn,
        finished=True,
        steps=3,
        train_reward=0.5,
        test_reward=0.4,
        steps_per_s=2.0,
        clip_fraction=clip_fraction,
        clip_low_fraction=0.0,
        clip_high_fraction=0.0,
        ratio_mean=1.0,
        ratio_min=ratio_min,
        ratio_max=ratio_max,
        mismatch_max_abs_log=mismatch,
        mismatch_kl=None if mismatch is None else mismatch / 10,
    )


def test_the_on_policy_warning_quotes_the_measured_mismatch() -> None:
    mismatched = on_policy_warning(
        [_stats("importance_sampling", 0.0, 0.9, 1.2, 0.15), _stats("ppo", 0.0, 0.9, 1.1, 0.2)]
    )
    assert mismatched is not None
    assert "at most 0.2 in |log ρ|" in mismatched and "did leave 1" in mismatched
    assert "r = exp(lp − lp_old) = 1 on every token" not in mismatched
    unlogged = on_policy_warning([_stats("importance_sampling", 0.0, 0.9, 1.0, None)])
    assert unlogged is not None and "`mismatch/*`) is not logged" in unlogged


def test_on_policy_warning_fires_when_ratios_stay_at_one() -> None:
    warning = on_policy_warning(
        [_stats("importance_sampling", 0.0, 1.0, 1.0), _stats("dro", 0.0, 0.9999, 1.0002)]
    )
    assert warning is not None
    assert (
        "max |ratio − 1| = 0.0002" in warning
        and "--num-substeps" in warning
        and "--max-steps-off-policy" in warning
    )


def test_on_policy_warning_fires_when_clip_losses_never_clipped() -> None:
    runs = [
        _stats("importance_sampling", 0.0, 0.9, 1.1),
        _stats("ppo", 0.0005, 0.85, 1.15),
        _stats("cispo", 0.0, 0.9, 1.1),
    ]
    assert on_policy_warning(runs) is not None


def test_on_policy_warning_is_silent_when_runs_went_off_policy() -> None:
    assert (
        on_policy_warning(
            [_stats("importance_sampling", 0.0, 0.5, 1.6), _stats("ppo", 0.08, 0.5, 1.7)]
        )
        is None
    )
    # DRO differs from IS off-policy even without clipping.
    assert (
        on_policy_warning(
            [_stats("importance_sampling", 0.0, 0.5, 1.6), _stats("dro", 0.0, 0.5, 1.7)]
        )
        is None
    )


def test_final_value_prefers_the_summary_test_reward(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {"step": 1, "reward": 0.1, "test/reward": 0.2},
        {"step": 2, "reward": 0.3},
        {"step": 3, "reward": 0.6},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_run(run_dir)
    assert final_value(run, "reward", 2) == pytest.approx(0.45)
    assert final_value(run, "test/reward", 2) == pytest.approx(0.2)
    (run_dir / "summary.json").write_text(
        json.dumps({"finished": True, "steps": 3, "wall_time_s": 6.0, "test/reward": 0.7})
    )
    run = read_run(run_dir)
    assert final_value(run, "test/reward", 2) == pytest.approx(0.7)
    assert steps_per_second(run) == pytest.approx(0.5)


# --- compare -------------------------------------------------------------------------------


def test_compare_runs_each_loss_and_seed_and_reports_numbers_from_the_metrics(
    tmp_path: Path, fake_trainer
) -> None:
    train_command, calls = fake_trainer
    out = tmp_path / "cmp"
    args = compare_args(
        out, "--steps", "4", "--learning-rate", "0.0002", "--last-steps", "2", "--jobs", "2"
    )
    assert run_compare(args, train_command=train_command) == 0

    names = ["importance_sampling-seed0", "importance_sampling-seed1", "ppo-seed0", "ppo-seed1"]
    assert sorted(path.name for path in out.iterdir() if path.is_dir()) == names
    for name in names:
        config = json.loads((out / name / "config.json").read_text())
        assert (config["steps"], config["learning_rate"]) == (4, 0.0002)
        assert (out / name / "summary.json").is_file()
        assert "--run-dir" in (out / name / "train.log").read_text()
    assert len(read_calls(calls)) == 4

    report = (out / "report.md").read_text()
    comparison = json.loads((out / "comparison.json").read_text())
    for loss, entry in zip(["importance_sampling", "ppo"], comparison["losses"], strict=True):
        train = [last_rewards_mean(out / f"{loss}-seed{seed}", 2) for seed in (0, 1)]
        test = [
            json.loads((out / f"{loss}-seed{seed}" / "summary.json").read_text())["test/reward"]
            for seed in (0, 1)
        ]
        clip = [
            np.mean(
                [
                    row[f"{loss}/clip_fraction"]
                    for row in metric_rows(out / f"{loss}-seed{seed}")
                    if "reward" in row
                ]
            )
            for seed in (0, 1)
        ]
        ratio_max = max(
            row[f"{loss}/ratio_max"]
            for seed in (0, 1)
            for row in metric_rows(out / f"{loss}-seed{seed}")
            if "reward" in row
        )
        assert entry["label"] == loss
        assert entry["train_reward"]["mean"] == pytest.approx(np.mean(train))
        assert entry["train_reward"]["std"] == pytest.approx(statistics.stdev(train))
        assert entry["test_reward"]["mean"] == pytest.approx(np.mean(test))
        assert entry["clip_fraction"]["mean"] == pytest.approx(np.mean(clip))
        assert entry["ratio_max"] == pytest.approx(ratio_max)
        assert entry["steps_per_s"]["mean"] == pytest.approx(2.0)
        row = next(line for line in report.splitlines() if line.startswith(f"| `{loss}` |"))
        assert f"{np.mean(train):.3f} ± {statistics.stdev(train):.3f}" in row
        half = student_t_quantile(0.975, 1) * statistics.stdev(test) / np.sqrt(2)
        mean = np.mean(test)
        assert f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]" in row
        assert entry["test_reward"]["interval"]["low"] == pytest.approx(mean - half)
        assert f"{np.mean(clip):.2%}" in row
        assert "| 2/2 |" in row
    assert "WARNING" not in report
    assert "--learning-rate 0.0002" in report and "--steps 4" in report
    assert "Test accuracy: no winner" in report or "overlaps none of the others" in report

    png = (out / "reward.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    specs = compare_specs(["importance_sampling", "ppo"], [0, 1], {}, out)
    figure = experiment_figure(
        specs, [read_run(spec.run_dir) for spec in specs], ["reward", "test/reward"], title=""
    )
    reward_ax, test_ax = figure.axes
    for index, loss in enumerate(["importance_sampling", "ppo"]):
        per_seed = [
            [row["reward"] for row in metric_rows(out / f"{loss}-seed{seed}") if "reward" in row]
            for seed in (0, 1)
        ]
        np.testing.assert_allclose(reward_ax.lines[index].get_xdata(), [1, 2, 3, 4])
        np.testing.assert_allclose(reward_ax.lines[index].get_ydata(), np.mean(per_seed, axis=0))
        np.testing.assert_allclose(test_ax.lines[index].get_xdata(), [4])


def test_compare_resumes_only_the_run_that_did_not_finish(
    tmp_path: Path, fake_trainer, monkeypatch
) -> None:
    train_command, calls = fake_trainer
    out = tmp_path / "cmp"
    monkeypatch.setenv("FAKE_CRASH", "ppo-seed1")
    assert run_compare(compare_args(out, "--steps", "3"), train_command=train_command) == 1
    assert not (out / "ppo-seed1" / "summary.json").exists()
    report = (out / "report.md").read_text()
    assert "did not finish: `ppo-seed1`" in report
    assert "| `ppo` | 1/2 |" in report

    monkeypatch.delenv("FAKE_CRASH")
    first_calls = len(read_calls(calls))
    assert run_compare(compare_args(out, "--steps", "3"), train_command=train_command) == 0
    new_calls = read_calls(calls)[first_calls:]
    assert new_calls == [["--resume", str(out / "ppo-seed1")]]
    rewards = [row["step"] for row in metric_rows(out / "ppo-seed1") if "reward" in row]
    assert rewards == [1, 2, 3]
    assert "did not finish" not in (out / "report.md").read_text()

    specs = compare_specs(["importance_sampling", "ppo"], [0, 1], {"steps": 3}, out)
    (out / "ppo-seed0" / "summary.json").unlink()
    outcomes = execute_runs(specs, jobs=1, train_command=train_command, echo=lambda line: None)
    assert [(outcome.action, outcome.returncode) for outcome in outcomes] == [
        ("skipped", None),
        ("skipped", None),
        ("resumed", 0),
        ("skipped", None),
    ]
    assert len(read_calls(calls)) == first_calls + 2


def test_compare_refuses_a_run_dir_made_with_other_settings(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    out = tmp_path / "cmp"
    assert run_compare(compare_args(out, "--steps", "2"), train_command=train_command) == 0
    launched = len(read_calls(calls))
    assert run_compare(compare_args(out, "--steps", "3"), train_command=train_command) == 2
    assert "steps: 2 there, 3 requested" in capsys.readouterr().err
    assert len(read_calls(calls)) == launched


def test_compare_groups_runs_by_the_experiment_and_a_moved_experiment_still_resumes(
    tmp_path: Path, fake_trainer
) -> None:
    train_command, calls = fake_trainer
    out = tmp_path / "cmp"
    assert run_compare(compare_args(out, "--steps", "2"), train_command=train_command) == 0
    launched = read_calls(calls)
    assert all(call[call.index("--tracker-group") + 1] == "cmp" for call in launched)
    moved = tmp_path / "cmp-moved"
    out.rename(moved)
    # The group follows the directory's name, so it differs now; it is not a setting.
    assert run_compare(compare_args(moved, "--steps", "2"), train_command=train_command) == 0
    assert len(read_calls(calls)) == len(launched)


def test_compare_warns_when_the_runs_were_on_policy(
    tmp_path: Path, fake_trainer, monkeypatch
) -> None:
    train_command, _ = fake_trainer
    monkeypatch.setenv("FAKE_RATIO_SPREAD", "0")
    out = tmp_path / "cmp"
    assert run_compare(compare_args(out, "--steps", "2"), train_command=train_command) == 0
    report = (out / "report.md").read_text()
    assert "WARNING: these runs were too on-policy" in report
    assert json.loads((out / "comparison.json").read_text())["warning"].startswith("**WARNING")


def test_compare_rejects_an_unknown_loss_before_running_anything(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    args = compare_args(tmp_path / "cmp")
    args.loss_fns = ["ppo", "grpo_magic"]
    assert run_compare(args, train_command=train_command) == 2
    assert "grpo_magic-seed0: --loss-fn 'grpo_magic' is not one of" in capsys.readouterr().err
    assert read_calls(calls) == []


def test_compare_validates_every_run_before_launching_any(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    out = tmp_path / "cmp"
    # Each flag is fine alone; no run can use this loss config, so none starts.
    assert (
        run_compare(compare_args(out, "--loss-config", "typo=1"), train_command=train_command) == 2
    )
    err = capsys.readouterr().err
    assert (
        f"run {out / 'importance_sampling-seed0'}: --loss-config: unknown config key 'typo'" in err
    )
    assert read_calls(calls) == []


# --- sweep ---------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_sweep_grid_ranks_configurations_by_the_mean_over_seeds(
    tmp_path: Path, fake_trainer
) -> None:
    train_command, calls = fake_trainer
    sweep_file = write(
        tmp_path / "lr.toml",
        """
        seeds = [0, 1]
        rank_by = "test/reward"
        [base]
        steps = 2
        loss_fn = "ppo"
        [grid]
        learning_rate = [1e-4, 3e-4]
        """,
    )
    out = tmp_path / "sweep"
    assert run_sweep(sweep_args(sweep_file, out), train_command=train_command) == 0
    assert len(read_calls(calls)) == 4
    result = json.loads((out / "sweep.json").read_text())
    labels = [entry["label"] for entry in result["configurations"]]
    assert labels == ["learning_rate=0.0003", "learning_rate=0.0001"]
    for entry in result["configurations"]:
        tests = [
            json.loads((out / f"{entry['label']}-seed{seed}" / "summary.json").read_text())[
                "test/reward"
            ]
            for seed in (0, 1)
        ]
        assert entry["metric"]["mean"] == pytest.approx(np.mean(tests))
        assert entry["overrides"]["learning_rate"] in (1e-4, 3e-4)
    report = (out / "report.md").read_text()
    table = [
        line for line in report.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert table[0].startswith("| 1 | `learning_rate=0.0003` |") and table[1].startswith(
        "| 2 | `learning_rate=0.0001` |"
    )
    assert "Fixed flags: `--steps 2 --loss-fn ppo`" in report
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")

    assert run_sweep(sweep_args(sweep_file, out), train_command=train_command) == 0
    assert len(read_calls(calls)) == 4


def test_sweep_runs_list_with_names_and_min_order(tmp_path: Path, fake_trainer) -> None:
    train_command, _ = fake_trainer
    sweep_file = write(
        tmp_path / "runs.toml",
        """
        seeds = [3]
        [base]
        steps = 3
        [[runs]]
        name = "is"
        loss_fn = "importance_sampling"
        [[runs]]
        loss_fn = "cispo"
        loss_config = {clip_high_threshold = 5.0}
        """,
    )
    out = tmp_path / "sweep"
    assert (
        run_sweep(
            sweep_args(
                sweep_file, out, "--rank-by", "reward", "--rank-order", "min", "--last-steps", "2"
            ),
            train_command=train_command,
        )
        == 0
    )
    result = json.loads((out / "sweep.json").read_text())
    assert [entry["label"] for entry in result["configurations"]] == [
        "is",
        "loss_fn=cispo,loss_config=clip_high_threshold=5.0",
    ]
    assert result["configurations"][0]["metric"]["mean"] == pytest.approx(
        last_rewards_mean(out / "is-seed3", 2)
    )
    config = json.loads(
        (
            out / "loss_fn=cispo,loss_config=clip_high_threshold=5.0-seed3" / "config.json"
        ).read_text()
    )
    assert config["loss_config"] == ["clip_high_threshold=5.0"]
    # one seed: the report asks for more the way a sweep takes them (it has no --seeds flag)
    report = (out / "report.md").read_text()
    assert "run 3 seeds or more (`seeds = [0, 1, 2]` in the sweep file)" in report
    assert "--seeds" not in report


def test_sweep_by_a_metric_no_run_logged_says_so_and_ranks_nothing(
    tmp_path: Path, fake_trainer
) -> None:
    train_command, _ = fake_trainer
    sweep_file = write(
        tmp_path / "s.toml", '[base]\nsteps = 2\n[grid]\nloss_fn = ["ppo", "cispo"]\n'
    )
    out = tmp_path / "sweep"
    assert (
        run_sweep(
            sweep_args(sweep_file, out, "--rank-by", "test/pass@4"), train_command=train_command
        )
        == 1
    )
    report = (out / "report.md").read_text()
    assert "WARNING: no run logged `test/pass@4`" in report
    assert "| – | `loss_fn=ppo` |" in report and "| – | `loss_fn=cispo` |" in report


def test_sweep_validates_every_run_before_launching_any(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    sweep_file = write(
        tmp_path / "sub.toml", "[base]\nbatch_size = 8\n[grid]\nnum_substeps = [1, 16]\n"
    )
    assert run_sweep(sweep_args(sweep_file, tmp_path / "out"), train_command=train_command) == 2
    err = capsys.readouterr().err
    run = tmp_path / "out" / "num_substeps=16-seed0"
    assert f"run {run}: --num-substeps must be in [1, --batch-size=8], got 16" in err
    assert read_calls(calls) == []


def test_sweep_loads_every_runs_reward_and_fewshot_file_before_launching_any(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    sweep_file = write(
        tmp_path / "inputs.toml",
        """
        [[runs]]
        name = "fine"
        [[runs]]
        name = "shots"
        fewshot_file = "no_such_shots.json"
        """,
    )
    assert run_sweep(sweep_args(sweep_file, tmp_path / "out"), train_command=train_command) == 2
    run = tmp_path / "out" / "shots-seed0"
    assert f"run {run}: --fewshot-file 'no_such_shots.json' not found" in capsys.readouterr().err
    assert read_calls(calls) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[base]\nstepz = 2\n[grid]\nseed_x = [1]\n",
            r"bad\.toml \[base\]: unknown train flag 'stepz' \(--stepz\)",
        ),
        (
            "[grid]\nlearning_rat = [1e-4, 2e-4]\n",
            r"bad\.toml \[grid\]: unknown train flag 'learning_rat'",
        ),
        ("[grid]\n", r"bad\.toml: \[grid\] is empty"),
        ("runs = []\n", r"bad\.toml: \[\[runs\]\] is empty"),
        ("[base]\nsteps = 2\n", r"bad\.toml: no configurations"),
        (
            "steps = 2\n[grid]\nlearning_rate = [1e-4]\n",
            r"unknown top-level key 'steps' \(train flags go under",
        ),
        ("[grid]\nlearning_rate = 1e-4\n", r"\[grid\] learning_rate must be a non-empty list"),
        (
            "[grid]\nlearning_rate = [1e-4]\n[[runs]]\nsteps = 1\n",
            r"both \[grid\] and \[\[runs\]\]",
        ),
        ("seeds = []\n[grid]\nsteps = [1]\n", r"seeds must be a non-empty list"),
        ("[grid]\nseed = [1, 2]\n", r"'seed' is set per run"),
        (
            "[[runs]]\nsteps = 1\n[[runs]]\nsteps = 1\n",
            r"two configurations are the same \(steps=1\)",
        ),
        ('rank_order = "best"\n[grid]\nsteps = [1]\n', r"rank_order must be"),
    ],
)
def test_load_sweep_rejects_bad_files_with_a_clear_message(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_sweep(write(tmp_path / "bad.toml", text))


def test_run_sweep_reports_a_missing_or_bad_file_without_running(
    tmp_path: Path, fake_trainer, capsys
) -> None:
    train_command, calls = fake_trainer
    assert (
        run_sweep(sweep_args(tmp_path / "nope.toml", tmp_path / "out"), train_command=train_command)
        == 2
    )
    assert f"sweep file {tmp_path / 'nope.toml'} not found" in capsys.readouterr().err
    bad = write(tmp_path / "bad.toml", "[grid]\nlearning_rat = [1e-4]\n")
    assert run_sweep(sweep_args(bad, tmp_path / "out"), train_command=train_command) == 2
    assert "unknown train flag 'learning_rat'" in capsys.readouterr().err
    assert read_calls(calls) == []


# --- the real trainer ----------------------------------------------------------------------


@pytest.mark.slow
def test_compare_end_to_end_with_the_real_trainer(tmp_path: Path) -> None:
    import grpo.cli  # noqa: F401 - an ImportError here fails the test: it runs the real trainer
    import grpo.training.recipes.grpo.run  # noqa: F401

    out = tmp_path / "cmp"
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args(
        [
            "--loss-fn",
            "importance_sampling",
            "ppo",
            "--seeds",
            "1",
            "--out",
            str(out),
            "--jobs",
            "2",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--group-size",
            "2",
            "--max-tokens",
            "8",
            "--eval-every",
            "0",
        ]
    )
    code = run_compare(args)
    logs = "\n".join(
        (path / "train.log").read_text()[-2000:]
        for path in out.iterdir()
        if (path / "train.log").is_file()
    )
    assert code == 0, logs
    for loss in ("importance_sampling", "ppo"):
        run = read_run(out / f"{loss}-seed0")
        assert run.summary is not None and run.summary["steps"] == 2
        assert [row["step"] for row in run.rows if "reward" in row] == [1, 2]
    comparison = json.loads((out / "comparison.json").read_text())
    assert [entry["label"] for entry in comparison["losses"]] == ["importance_sampling", "ppo"]
    assert all(entry["train_reward"]["n"] == 1 for entry in comparison["losses"])
    assert (out / "reward.png").stat().st_size > 0


def test_separation_calls_no_winner_when_the_best_interval_overlaps_another() -> None:
    close = [("a", mean_std([0.60, 0.64, 0.62])), ("b", mean_std([0.58, 0.63, 0.61]))]
    assert separation(close, what="Test accuracy", more_seeds="m").startswith(
        "Test accuracy: no winner."
    )
    assert "`a` and `b` overlap" in separation(close, what="Test accuracy", more_seeds="m")
    apart = [("a", mean_std([0.90, 0.91, 0.92])), ("b", mean_std([0.10, 0.11, 0.12]))]
    assert "`a` is ahead" in separation(
        apart, what="x", more_seeds="m"
    ) and "overlaps none" in separation(apart, what="x", more_seeds="m")
    single = [("a", mean_std([0.9])), ("b", mean_std([0.1]))]
    assert "no interval" in separation(single, what="x", more_seeds="`--seeds 3`")
    assert "run 3 seeds or more (`--seeds 3`)" in separation(
        single, what="x", more_seeds="`--seeds 3`"
    )
    assert separation(single[:1], what="x", more_seeds="m") is None


def test_a_stat_formats_its_t_interval_and_alone_for_one_seed() -> None:
    stat = mean_std([1.0, 2.0, 3.0])
    half = student_t_quantile(0.975, 2) * 1.0 / np.sqrt(3)
    assert stat.format_interval() == f"2.000 [{2 - half:.3f}, {2 + half:.3f}]"
    assert mean_std([0.5]).format_interval() == "0.500" and mean_std([]).format_interval() == "–"


def test_a_trainers_progress_bars_leave_no_fragments_in_its_train_log(tmp_path: Path) -> None:
    trainer = tmp_path / "barred_trainer.py"
    trainer.write_text(
        "import sys\nfrom pathlib import Path\nfrom tqdm import tqdm\n"
        "for _ in tqdm(range(50), mininterval=0):\n    pass\n"
        "print('trained')\n"
        "run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])\n"
        "(run_dir / 'summary.json').write_text('{}')\n"
    )
    specs = compare_specs(["importance_sampling"], [0], {"steps": 1}, tmp_path / "out")
    [outcome] = execute_runs(
        specs, jobs=1, train_command=[sys.executable, str(trainer)], echo=lambda line: None
    )
    assert outcome.returncode == 0
    log = (specs[0].run_dir / "train.log").read_bytes()  # read_text would turn \r into \n
    assert b"trained\n" in log and b"\r" not in log


def test_runs_are_announced_when_they_start_and_counted_as_they_end(
    tmp_path: Path, fake_trainer
) -> None:
    train_command, _ = fake_trainer
    out = tmp_path / "cmp"
    specs = compare_specs(["importance_sampling", "ppo"], [0, 1], {"steps": 2}, out)
    execute_runs(specs[:1], jobs=1, train_command=train_command, echo=lambda line: None)
    lines: list[str] = []
    execute_runs(specs, jobs=1, train_command=train_command, echo=lines.append)
    names = [spec.run_dir for spec in specs]
    # one trainer at a time: each run starts only after the one before it has ended
    assert [line.split(" (log:")[0].split(" in ")[0] for line in lines[:-1]] == [
        f"skip   {names[0]} (finished)",
        f"start  {names[1]}",
        f"done 1/3 {names[1]}",
        f"start  {names[2]}",
        f"done 2/3 {names[2]}",
        f"start  {names[3]}",
        f"done 3/3 {names[3]}",
    ]
