"""`grpo plot` and `grpo plot-losses`: the plotted data, checked line by line."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from grpo.core.evaluation import student_t_quantile
from grpo.tools import plots
from grpo.tools.plots import (
    add_plot_arguments,
    add_plot_losses_arguments,
    band_figure,
    default_metrics,
    loss_shape_curves,
    mean_band,
    metrics_figure,
    read_run_metrics,
    run_plot,
    run_plot_losses,
)


def write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def training_rows(loss: str, rewards: list[float], clip: list[float]) -> list[dict]:
    rows = [
        {
            "step": step,
            "reward": reward,
            "frac_degenerate": 0.25,
            "loss": -reward,
            f"{loss}/clip_fraction": fraction,
        }
        for step, (reward, fraction) in enumerate(zip(rewards, clip, strict=True), start=1)
    ]
    return rows + [{"step": len(rewards), "test/reward": rewards[-1] / 2}]


def plot_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    return parser.parse_args(list(argv))


def test_plot_of_a_row_with_a_null_step_names_the_file_and_line(tmp_path: Path, capsys) -> None:
    rows = [{"step": 1, "reward": 0.1}, {"step": None, "reward": 0.2}, {"step": 3, "reward": 0.3}]
    run = write_run(tmp_path / "run", rows)
    assert run_plot(plot_args(str(run), "--out", str(tmp_path / "x.png"))) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'} line 2 is not a metrics row" in err and "Traceback" not in err


def test_mean_band_is_the_mean_min_and_max_of_the_runs_at_each_step() -> None:
    band = mean_band(
        [
            (np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 2.0])),
            (np.array([1.0, 2.0]), np.array([2.0, 5.0])),
        ]
    )
    np.testing.assert_array_equal(band.steps, [1, 2, 3])
    np.testing.assert_allclose(band.mean, [1.0, 3.0, 2.0])
    np.testing.assert_allclose(band.low, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(band.high, [2.0, 5.0, 2.0])
    np.testing.assert_array_equal(band.count, [2, 2, 1])


def test_plot_of_two_runs_draws_each_runs_metrics(tmp_path: Path) -> None:
    ppo = write_run(tmp_path / "ppo-seed0", training_rows("ppo", [0.1, 0.2, 0.4], [0.0, 0.1, 0.2]))
    cispo = write_run(
        tmp_path / "cispo-seed0", training_rows("cispo", [0.3, 0.3, 0.5], [0.05, 0.0, 0.3])
    )
    runs = {"ppo-seed0": read_run_metrics(ppo), "cispo-seed0": read_run_metrics(cispo)}
    metrics = default_metrics(runs)
    assert metrics == ["reward", "frac_degenerate", "clip_fraction", "loss", "test/reward"]
    figure = metrics_figure(runs, metrics)
    panels = {ax.get_title(): ax for ax in figure.axes}
    reward = panels["reward"]
    assert [line.get_label() for line in reward.lines] == ["ppo-seed0", "cispo-seed0"]
    np.testing.assert_allclose(reward.lines[0].get_ydata(), [0.1, 0.2, 0.4])
    np.testing.assert_allclose(reward.lines[1].get_ydata(), [0.3, 0.3, 0.5])
    np.testing.assert_allclose(panels["clip_fraction"].lines[0].get_ydata(), [0.0, 0.1, 0.2])
    np.testing.assert_allclose(panels["clip_fraction"].lines[1].get_ydata(), [0.05, 0.0, 0.3])
    np.testing.assert_allclose(panels["test/reward"].lines[1].get_xdata(), [3])
    np.testing.assert_allclose(panels["test/reward"].lines[1].get_ydata(), [0.25])

    out = tmp_path / "plot.png"
    assert (
        run_plot(
            plot_args(
                str(ppo), str(cispo), "--metrics", "reward", "ppo/clip_fraction", "--out", str(out)
            )
        )
        == 0
    )
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 5000


def test_plot_of_an_unknown_metric_lists_the_available_ones(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "ppo-seed0", training_rows("ppo", [0.1, 0.2], [0.0, 0.1]))
    assert (
        run_plot(
            plot_args(str(run), "--metrics", "reward", "rewrad", "--out", str(tmp_path / "x.png"))
        )
        == 2
    )
    message = capsys.readouterr().err
    assert "unknown metric 'rewrad'" in message
    assert "frac_degenerate, loss, ppo/clip_fraction, reward, test/reward" in message
    assert "by suffix: clip_fraction" in message
    assert not (tmp_path / "x.png").exists()


def test_plot_of_a_directory_without_metrics_says_so(tmp_path: Path, capsys) -> None:
    assert run_plot(plot_args(str(tmp_path))) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_one_run_plot_defaults_to_the_run_directory(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", training_rows("importance_sampling", [0.1, 0.2], [0.0, 0.0]))
    assert run_plot(plot_args(str(run))) == 0
    assert (run / "metrics.png").stat().st_size > 0


# --- loss shapes -------------------------------------------------------------------------------

RATIOS = np.array([0.2, 0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0, 2.99, 3.01, 3.99, 4.01, 5.0])
LP_OLD = math.log(plots.LOSS_SHAPE_SAMPLING_PROB)


def shapes_by_name(advantage: float) -> dict[str, plots.LossShape]:
    return {shape.label.split(" (")[0]: shape for shape in loss_shape_curves(advantage, RATIOS)}


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_loss_shapes_follow_the_formulas(advantage: float) -> None:
    shapes = shapes_by_name(advantage)
    logprobs = LP_OLD + np.log(RATIOS)
    clipped_ppo = np.clip(RATIOS, 0.8, 1.2)
    clipped_cispo = np.clip(RATIOS, 0.0, 4.0)
    np.testing.assert_allclose(shapes["importance_sampling"].objective, RATIOS * advantage)
    np.testing.assert_allclose(shapes["importance_sampling"].gradient_weight, RATIOS * advantage)
    np.testing.assert_allclose(
        shapes["ppo"].objective, np.minimum(RATIOS * advantage, clipped_ppo * advantage)
    )
    np.testing.assert_allclose(shapes["cispo"].objective, clipped_cispo * logprobs * advantage)
    np.testing.assert_allclose(shapes["cispo"].gradient_weight, clipped_cispo * advantage)
    np.testing.assert_allclose(
        shapes["dro"].objective, logprobs * advantage - 0.05 / 2 * np.log(RATIOS) ** 2
    )
    np.testing.assert_allclose(shapes["dro"].gradient_weight, advantage - 0.05 * np.log(RATIOS))


def test_ppo_gradient_is_zero_on_the_clipped_side_only() -> None:
    positive, negative = shapes_by_name(1.0)["ppo"], shapes_by_name(-1.0)["ppo"]
    above, below = RATIOS > 1.2, RATIOS < 0.8
    np.testing.assert_array_equal(positive.gradient_weight[above], 0.0)
    np.testing.assert_allclose(positive.gradient_weight[~above], RATIOS[~above])
    np.testing.assert_array_equal(negative.gradient_weight[below], 0.0)
    np.testing.assert_allclose(negative.gradient_weight[~below], -RATIOS[~below])


def test_ppo_dual_clip_curve_appears_for_negative_advantages_and_stops_the_gradient_past_c() -> (
    None
):
    assert "ppo dual_clip=3" not in shapes_by_name(1.0)
    dual = shapes_by_name(-1.0)["ppo dual_clip=3"]
    past = RATIOS > 3.0
    np.testing.assert_array_equal(dual.gradient_weight[past], 0.0)
    np.testing.assert_allclose(dual.objective[past], -3.0)
    inside = (RATIOS >= 0.8) & ~past
    np.testing.assert_allclose(dual.gradient_weight[inside], -RATIOS[inside])


def test_loss_shapes_figure_draws_the_kernel_curves(tmp_path: Path) -> None:
    figure = plots.loss_shapes_figure(RATIOS)
    objective_positive, objective_negative, weight_positive, weight_negative = figure.axes
    for ax, advantage, field in [
        (objective_positive, 1.0, "objective"),
        (objective_negative, -1.0, "objective"),
        (weight_positive, 1.0, "gradient_weight"),
        (weight_negative, -1.0, "gradient_weight"),
    ]:
        shapes = loss_shape_curves(advantage, RATIOS)
        curves = ax.lines[: len(shapes)]
        assert [line.get_label() for line in curves] == [shape.label for shape in shapes]
        for line, shape in zip(curves, shapes, strict=True):
            np.testing.assert_allclose(line.get_xdata(), RATIOS)
            np.testing.assert_allclose(line.get_ydata(), getattr(shape, field))
    parser = argparse.ArgumentParser()
    add_plot_losses_arguments(parser)
    out = tmp_path / "docs" / "loss_shapes.png"
    assert run_plot_losses(parser.parse_args(["--out", str(out)])) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 20000


def test_mean_band_carries_the_t_interval_of_the_mean_where_two_seeds_logged() -> None:
    band = mean_band(
        [
            (np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 2.0])),
            (np.array([1.0, 2.0]), np.array([2.0, 5.0])),
        ]
    )
    half = student_t_quantile(0.975, 1) * np.array([np.sqrt(2), np.sqrt(8)]) / np.sqrt(2)
    np.testing.assert_allclose(band.ci_low[:2], band.mean[:2] - half)
    np.testing.assert_allclose(band.ci_high[:2], band.mean[:2] + half)
    assert np.isnan(band.ci_low[2]) and np.isnan(band.ci_high[2])


def _look(line) -> tuple:
    return (line.get_linestyle(), line.get_marker())


def test_identical_curves_stay_visible_each_in_its_own_style_over_a_wider_one(
    tmp_path: Path,
) -> None:
    rows = training_rows("importance_sampling", [0.1, 0.2, 0.4, 0.5], [0.0, 0.0, 0.0, 0.0])
    same = [write_run(tmp_path / name, rows) for name in ("is", "cispo", "ppo")]
    runs = {path.name: read_run_metrics(path) for path in same}
    groups = {name: [metrics] for name, metrics in runs.items()}
    for figure in (
        metrics_figure(runs, ["reward", "test/reward"]),
        band_figure(groups, ["reward"]),
    ):
        for ax in figure.axes:
            lines = ax.lines[:3]
            assert [line.get_label().split(" ")[0] for line in lines] == ["is", "cispo", "ppo"]
            assert len({_look(line) for line in lines}) == 3  # each curve its own dashes, marks
            widths = [line.get_linewidth() for line in lines]
            assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3
    out = tmp_path / "same.png"
    assert run_plot(plot_args(*map(str, same), "--metrics", "reward", "--out", str(out))) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
