"""Bring your own task, end to end on the local backend: rewards, dynamic sampling,
--mask-truncated, rollouts.jsonl and `grpo show`."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from grpo.cli import main
from grpo.training.recipes.grpo.run import RunStopped
from grpo.training.run import run_files
from grpo.training.run.run_files import read_metrics, read_rollouts
from grpo.training.settings.config import TrainConfig
from tests.invariance import assert_same_rollouts, assert_same_rows
from tests.runs import comparable, embedded_service, quiet_train, tiny_config


def reward_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "task_rewards.py"
    path.write_text(textwrap.dedent(body))
    return path


def by_step(groups: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = {}
    for group in groups:
        steps.setdefault(group["step"], []).append(group)
    return steps


def test_weighted_rewards_are_logged_per_component_and_rollouts_agree_with_metrics(
    tmp_path: Path,
) -> None:
    path = reward_file(
        tmp_path,
        """
        def short(completion, row):
            return 1.0 if len(completion) <= 18 else 0.0
        """,
    )
    config = tiny_config(
        tmp_path,
        "weighted",
        steps=3,
        batch_size=3,
        reward=("grpo.rewards:boxed_match", f"{path}:short=0.5"),
        log_rollouts=3,
    )
    run_dir = quiet_train(config).run_dir
    rows = read_metrics(run_dir)
    groups = by_step(read_rollouts(run_dir))
    assert sorted(groups) == [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["reward"] == pytest.approx(row["reward/boxed_match"] + 0.5 * row["reward/short"])
        completions = [c for group in groups[row["step"]] for c in group["completions"]]
        assert len(completions) == row["num_completions"] == 12
        assert np.mean([c["reward"] for c in completions]) == pytest.approx(row["reward"])
        for name in ("boxed_match", "short"):
            values = [c["components"][name] for c in completions]
            assert np.mean(values) == pytest.approx(row[f"reward/{name}"])
        assert np.mean([c["tokens"] for c in completions]) == pytest.approx(
            row["rollout/avg_gen_len"]
        )
        degenerate = [group["degenerate"] for group in groups[row["step"]]]
        assert np.mean(degenerate) == pytest.approx(row["frac_degenerate"])
        trained = [c for g in groups[row["step"]] if not g["degenerate"] for c in g["completions"]]
        assert row["datums"] == len(trained)
        for group in groups[row["step"]]:
            rewards = np.array([c["reward"] for c in group["completions"]])
            advantages = [c["advantage"] for c in group["completions"]]
            assert advantages == pytest.approx(rewards - rewards.mean())


def test_a_raising_reward_stops_the_run_with_a_checkpoint_naming_row_and_completion(
    tmp_path: Path,
) -> None:
    path = reward_file(
        tmp_path,
        """
        CALLS = []

        def flaky(completion, row):
            CALLS.append(completion)
            if len(CALLS) == 11:  # 8 calls a step: the third call of step 2 fails
                raise RuntimeError("judge unavailable")
            return float(len(completion) % 2)
        """,
    )
    config = tiny_config(tmp_path, "flaky", steps=3, reward=(f"{path}:flaky",))
    with pytest.raises(RunStopped) as stopped:
        quiet_train(config)
    message = str(stopped.value)
    assert stopped.value.exit_code == 1
    assert "run failed at step 2: RewardError" in message
    assert "raised RuntimeError: judge unavailable on row" in message
    assert "for the completion '" in message and "--reward-errors zero" in message
    assert json.loads((tmp_path / "flaky" / "checkpoint.json").read_text())["step"] == 1
    assert [row["step"] for row in read_metrics(tmp_path / "flaky")] == [1]


def test_a_nan_reward_under_reward_errors_zero_scores_zero_and_is_counted(tmp_path: Path) -> None:
    path = reward_file(
        tmp_path,
        """
        def odd_rows_nan(completion, row, sample):
            return float("nan") if sample.index % 2 else 1.0
        """,
    )
    config = tiny_config(
        tmp_path, "nan", reward=(f"{path}:odd_rows_nan",), reward_errors="zero", batch_size=4
    )
    run_dir = quiet_train(config).run_dir
    rows = read_metrics(run_dir)
    for row, groups in zip(rows, by_step(read_rollouts(run_dir)).values(), strict=True):
        odd = [group for group in groups if group["row"] % 2]
        assert row["reward/errors"] == 4 * len(odd)
        assert row["reward"] == 1 - len(odd) / 4
        assert all(c["reward"] == 0.0 for group in odd for c in group["completions"])
    assert sum(row["reward/errors"] for row in rows) > 0, "no odd row sampled: test setup"


SPARSE = """
def sparse(completion, row, sample):
    return float(sample.index % 3 == 0 and sample.num_tokens % 2 == 0)

def constant(completion, row):
    return 1.0
"""


def _dynamic(tmp_path: Path, name: str, reward: str | None, **overrides: Any) -> TrainConfig:
    path = reward_file(tmp_path, SPARSE)
    values = dict(
        steps=3,
        batch_size=3,
        dynamic_sampling=True,
        max_sampling_rounds=3,
        reward=(f"{path}:{reward}",) if reward else (),
        log_rollouts=0,
    )
    return tiny_config(tmp_path, name, **{**values, **overrides})


def _check_dynamic_invariants(
    rows: list[dict[str, Any]], batch_size: int, group_size: int, max_rounds: int
) -> None:
    for row in rows:
        rounds, groups = row["sampling/rounds"], row["sampling/groups"]
        nondegenerate = round(row["num_groups"] * (1 - row["frac_degenerate"]))
        assert 1 <= rounds <= max_rounds
        assert row["num_groups"] == rounds * batch_size
        assert groups == min(batch_size, nondegenerate)
        assert row["datums"] == groups * group_size
        if groups < batch_size:
            assert rounds == max_rounds  # the cap stopped it
        assert (row["sampling/extra_tokens"] > 0) == (rounds > 1)


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_or_stops_at_the_round_cap(tmp_path: Path) -> None:
    rows = read_metrics(quiet_train(_dynamic(tmp_path, "sparse", "sparse")).run_dir)
    _check_dynamic_invariants(rows, batch_size=3, group_size=4, max_rounds=3)
    assert any(row["sampling/rounds"] > 1 for row in rows), "no extra round: test setup"
    again = read_metrics(quiet_train(_dynamic(tmp_path, "sparse-again", "sparse")).run_dir)
    assert_same_rows(comparable(again), comparable(rows))  # deterministic under the seed

    constant = read_metrics(
        quiet_train(_dynamic(tmp_path, "constant", "constant", steps=1)).run_dir
    )
    assert constant[0]["sampling/rounds"] == 3 and constant[0]["sampling/groups"] == 0
    assert constant[0]["datums"] == 0 and "loss" not in constant[0]


def test_dynamic_sampling_on_the_default_reward_with_the_off_policy_pipeline(
    tmp_path: Path,
) -> None:
    config = _dynamic(
        tmp_path,
        "default",
        None,
        max_sampling_rounds=4,
        max_steps_off_policy=1,
    )
    rows = read_metrics(quiet_train(config).run_dir)
    _check_dynamic_invariants(rows, batch_size=3, group_size=4, max_rounds=4)
    assert all(row["off_policy_steps"] <= 1 for row in rows)


def test_dynamic_sampling_counts_every_rounds_tokens_in_the_usage(tmp_path: Path) -> None:
    run_dir = quiet_train(_dynamic(tmp_path, "usage", None, log_rollouts=100)).run_dir
    rows, groups = read_metrics(run_dir), by_step(read_rollouts(run_dir))
    assert any(row["sampling/rounds"] > 1 for row in rows), "no extra round: test setup"
    for row, logged in zip(rows, groups.values(), strict=True):
        sampled = sum(c["tokens"] for group in logged for c in group["completions"])
        assert row["usage/completion_tokens"] == sampled


def test_dynamic_sampling_resumes_exactly(tmp_path: Path) -> None:
    from tests.training.test_loop import _StopAfterOptimSteps

    whole = quiet_train(_dynamic(tmp_path, "whole", None, steps=4, log_rollouts=2)).run_dir
    assert any(row["sampling/rounds"] > 1 for row in read_metrics(whole)), "test setup"
    config = _dynamic(tmp_path, "stopped", None, steps=4, log_rollouts=2)
    service = _StopAfterOptimSteps(
        embedded_service(tmp_path / "stopped" / "backend", seed=config.seed), n=2
    )
    with pytest.raises(RunStopped):
        quiet_train(config, service_client=service)
    checkpoint = json.loads((tmp_path / "stopped" / "checkpoint.json").read_text())["step"]
    assert 1 <= checkpoint < 4
    resumed = quiet_train(config, resume=True).run_dir
    assert_same_rows(comparable(read_metrics(resumed)), comparable(read_metrics(whole)))
    assert_same_rollouts(read_rollouts(resumed), read_rollouts(whole))


def test_mask_truncated_trains_only_the_completions_that_finished(tmp_path: Path) -> None:
    # A reward that tells cut-off from finished completions: every trained group mixes both.
    path = reward_file(
        tmp_path, "def cut(completion, row, sample):\n    return float(sample.truncated)\n"
    )
    config = tiny_config(
        tmp_path,
        "masked",
        steps=3,
        batch_size=4,
        max_tokens=16,
        temperature=1.5,  # answers of 11-16 tokens and some longer: mixed groups every step
        mask_truncated=True,
        log_rollouts=4,
        reward=(f"{path}:cut",),
    )
    run_dir = quiet_train(config).run_dir
    rows = read_metrics(run_dir)
    groups = by_step(read_rollouts(run_dir))
    truncated = 0
    for row in rows:
        trained = [c for g in groups[row["step"]] if not g["degenerate"] for c in g["completions"]]
        finished = [c for c in trained if c["stop_reason"] != "length"]
        truncated += len(trained) - len(finished)
        assert row["train_tokens"] == sum(c["tokens"] for c in finished)
        assert row["datums"] == len(trained)
    assert truncated > 0 and rows[0]["rollout/frac_truncated"] < 1, "test setup"

    unmasked = read_metrics(
        quiet_train(
            attrs.evolve(config, run_dir=str(tmp_path / "unmasked"), steps=1, mask_truncated=False)
        ).run_dir
    )
    trained = [c for g in groups[1] if not g["degenerate"] for c in g["completions"]]
    assert unmasked[0]["train_tokens"] == sum(c["tokens"] for c in trained)


def test_overlong_penalty_is_a_reward_component(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        "overlong",
        steps=1,
        batch_size=4,
        max_tokens=20,
        overlong_buffer=4,
        reward=("grpo.rewards:boxed_match", "grpo.rewards:overlong_penalty=1"),
    )
    run_dir = quiet_train(config).run_dir
    for group in read_rollouts(run_dir):
        for completion in group["completions"]:
            expected = -min(1.0, max(0.0, (completion["tokens"] - 16) / 4))
            assert completion["components"]["overlong_penalty"] == expected


def test_grpo_show_prints_a_step_and_writes_html(tmp_path: Path, capsys) -> None:
    run_dir = quiet_train(tiny_config(tmp_path, "shown", log_rollouts=1)).run_dir
    (group,) = [g for g in read_rollouts(run_dir) if g["step"] == 1]
    assert main(["show", str(run_dir), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 1: reward ")
    assert f"== group 0 | row {group['row']} | gold {group['gold']!r}" in out
    for member, completion in enumerate(group["completions"]):
        assert f"[{member}] reward {completion['reward']:.4g}" in out
        assert completion["text"].split("\n")[0] in out
    assert main(["show", str(run_dir), "--step", "1", "--worst"]) == 0
    worst = capsys.readouterr().out
    assert worst.count("] reward ") == 1
    assert f"reward {min(c['reward'] for c in group['completions']):.4g} (" in worst
    assert main(["show", str(run_dir), "--step", "7"]) == 2
    assert "--step 7" in capsys.readouterr().err
    html_path = tmp_path / "out.html"
    assert main(["show", str(run_dir), "--html", str(html_path)]) == 0
    page = html_path.read_text()
    assert "<section id='step-1'>" in page and "<section id='step-2'>" in page
    assert "src=" not in page and "href='http" not in page  # self-contained
    assert (run_dir / run_files.ROLLOUTS_FILE).stat().st_size < 20_000


def test_resume_truncates_rollouts_like_metrics(tmp_path: Path) -> None:
    path = tmp_path / run_files.ROLLOUTS_FILE
    lines = [{"step": step, "group": 0} for step in (1, 2, 2, 3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "gr')
    assert run_files.prepare_rollouts_for_resume(tmp_path, 2) == 2
    assert read_rollouts(tmp_path) == lines[:3]
    assert run_files.prepare_rollouts_for_resume(tmp_path, None) == 3
    assert read_rollouts(tmp_path) == []


def test_extra_rounds_draw_their_own_problems_and_seeds() -> None:
    from grpo.training.run.seeds import extra_batch, extra_sampling_seed, sampling_seed

    seeds = {
        (round_, index): extra_sampling_seed(3, 5, round_, index)
        for round_ in (1, 2, 3)
        for index in range(8)
    }
    first_round = {sampling_seed(3, 5, index) for index in range(8)}
    assert len(set(seeds.values())) == len(seeds) and not first_round & set(seeds.values())
    assert seeds == {key: extra_sampling_seed(3, 5, *key) for key in seeds}  # pure
    assert extra_sampling_seed(4, 5, 1, 0) != seeds[1, 0] != extra_sampling_seed(3, 6, 1, 0)
    batches = [extra_batch(100, 8, 5, round_, 3).tolist() for round_ in (1, 2)]
    assert batches[0] != batches[1] and batches[0] == extra_batch(100, 8, 5, 1, 3).tolist()
    assert all(len(set(batch)) == 8 for batch in batches)
    assert sorted(extra_batch(5, 8, 0, 1, 0).tolist()) == [0, 1, 2, 3, 4]


def test_swanlab_receives_the_logged_groups_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.training.run.run_log import RunLogger

    class FakeSwanlab:
        """The swanlab module surface RunLogger uses: init, Text, log, finish."""

        def __init__(self) -> None:
            self.inits: list[dict[str, Any]] = []
            self.logged: list[tuple[dict[str, Any], int]] = []
            self.finished = 0

        def init(self, **kwargs: Any) -> None:
            self.inits.append(kwargs)

        @staticmethod
        def Text(content: str, caption: str | None = None) -> tuple[str, str | None]:  # noqa: N802
            return content, caption

        def log(self, payload: dict[str, Any], step: int) -> None:
            self.logged.append((payload, step))

        def finish(self) -> None:
            self.finished += 1

    group = {
        "group": 0,
        "row": 4,
        "prompt": "What is 1 plus 1?",
        "gold": "2",
        "degenerate": False,
        "completions": [
            {
                "text": "\\boxed{2}",
                "reward": 1.0,
                "components": {"boxed_match": 1.0},
                "advantage": 0.5,
                "tokens": 6,
                "stop_reason": "stop",
            }
        ],
    }
    fake = FakeSwanlab()
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    from grpo.training.trackers.base import RunInfo

    run = RunInfo(
        run_dir=tmp_path, run_name="r", project="p", group=None, tags=(), swanlab_mode="offline"
    )
    logger = RunLogger(
        tmp_path, config={"steps": 1, "api_key": "sk-secret"}, run=run, log_to=("swanlab",)
    )
    logger.log(1, {"reward": 1.0}, rollouts=[group])
    logger.close()  # the trackers run on threads of their own: closing waits for them
    assert fake.finished == 1
    assert fake.inits == [
        {
            "project": "p",
            "experiment_name": "r",
            "config": {"steps": 1},
            "mode": "offline",
            "logdir": str(tmp_path / "swanlog"),
        }
    ]
    ((payload, step),) = fake.logged
    assert step == 1 and payload["reward"] == 1.0
    text = (
        "prompt (row 4, gold '2'):\n"
        "What is 1 plus 1?\n"
        "\n"
        "--- completion 0: reward 1 (boxed_match=1), advantage +0.500, 6 tokens, stop stop\n"
        "\\boxed{2}"
    )
    assert payload["rollouts"] == [(text, "group 0")]
    assert read_rollouts(tmp_path) == [{"step": 1, **group}]
