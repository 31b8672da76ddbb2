"""Rollouts sampled ahead of a checkpoint: saved with it, loaded back only when they fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from grpo.core.episodes import Episode, Turn
from grpo.core.records import Completion
from grpo.core.usage import TokenUsage
from grpo.training.rollouts.grading import PlayedGroups
from grpo.training.rollouts.problems import Problem
from grpo.training.run.ahead import ReadyJob, ahead_path, load_ahead, prune_ahead, save_ahead
from grpo.training.run.seeds import pick_batch

PROBLEMS = [Problem(f"q{i}", str(i), (1, 2, 3 + i), index=i) for i in range(10)]
BATCH, SEED, K = 3, 5, 2


class _Job:
    """A job in flight as the loop holds it: problems, sampler version, result(), usage()."""

    def __init__(self, step: int, sampler_version: int, outcome: Any, fails: bool = False):
        self.problems = [PROBLEMS[i] for i in pick_batch(len(PROBLEMS), BATCH, step, SEED)]
        self.sampler_version, self._outcome, self._fails = sampler_version, outcome, fails
        self.waited = 0

    def result(self) -> Any:
        self.waited += 1
        if self._fails:
            raise RuntimeError("sampling failed")
        return self._outcome

    def usage(self) -> TokenUsage:
        return TokenUsage(prompt_tokens=7, completion_tokens=11)


def _completions(seed: int) -> list[list[Completion]]:
    rng = np.random.default_rng(seed)
    return [
        [
            Completion(
                tokens=rng.integers(0, 50, size=4),
                logprobs=-rng.random(4) * 3,  # full float64 precision must survive JSON
                text=f"\\boxed{{{g}}} <é>",
                stop_reason="stop",
            )
            for g in range(2)
        ]
        for _ in range(BATCH)
    ]


def _load(run_dir: Path, notes: list[str], **overrides: Any) -> dict[int, ReadyJob]:
    arguments: dict[str, Any] = dict(
        problems=PROBLEMS,
        batch_size=BATCH,
        seed=SEED,
        max_steps_off_policy=K,
        steps=10,
        version=4,
        note=notes.append,
    )
    arguments.update(overrides)
    state_path = arguments.pop("state_path", f"local://{run_dir}/backend/r/weights/step-000003")
    return load_ahead(run_dir, 3, state_path, **arguments)


def _equal(first: list[list[Completion]], second: list[list[Completion]]) -> bool:
    return all(
        np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.logprobs, b.logprobs)
        and (a.text, a.stop_reason) == (b.text, b.stop_reason)
        for group_a, group_b in zip(first, second, strict=True)
        for a, b in zip(group_a, group_b, strict=True)
    )


def _save(run_dir: Path, jobs: dict[int, Any], version: int = 6) -> None:
    save_ahead(run_dir, 3, f"local://{run_dir}/backend/r/weights/step-000003", jobs, version)


def test_completions_come_back_exactly_with_their_staleness(tmp_path: Path):
    outcomes = {3: _completions(0), 4: _completions(1)}
    jobs: dict[int, Any] = {3: _Job(3, 5, outcomes[3]), 4: _Job(4, 6, outcomes[4])}
    in_flight = dict(jobs)
    _save(tmp_path, jobs, version=6)
    # The loop's jobs are now finished ones: the step that takes them does not wait again.
    assert all(isinstance(job, ReadyJob) for job in jobs.values())
    assert [in_flight[step].waited for step in (3, 4)] == [1, 1]
    notes: list[str] = []
    loaded = _load(tmp_path, notes, version=4)
    assert notes == [] and sorted(loaded) == [3, 4]
    # Saved 1 and 0 updates behind version 6; the resumed run is at version 4.
    assert [loaded[step].sampler_version for step in (3, 4)] == [3, 4]
    for step in (3, 4):
        assert _equal(loaded[step].result(), outcomes[step])
        assert loaded[step].usage() == TokenUsage(prompt_tokens=7, completion_tokens=11)
        assert list(loaded[step].problems) == in_flight[step].problems


def test_episodes_come_back_exactly(tmp_path: Path):
    episode = Episode(
        turns=(
            Turn(
                observation_tokens=[1, 2],
                action_tokens=[3, 4, 5],
                action_logprobs=[-0.1, -1 / 3, -2.0],
                reward=0.5,
                action_text="<tool_call>x</tool_call>",
                tool_calls=1,
                tool_errors=1,
            ),
            Turn(observation_tokens=[6], action_tokens=[7], action_logprobs=[-0.7]),
        ),
        final_reward=1.0,
    )
    problems = tuple(PROBLEMS[i] for i in pick_batch(len(PROBLEMS), BATCH, 3, SEED))
    played = PlayedGroups(
        problems_P=problems,
        episodes_P=tuple((episode, episode) for _ in problems),
        seen_P=tuple((("obs a", "obs b"), ("c",)) for _ in problems),
        usage=TokenUsage(prompt_tokens=3, completion_tokens=9),
    )
    job = _Job(3, 6, played)  # an episode job's usage is in its result, not usage()
    _save(tmp_path, {3: job})
    notes: list[str] = []
    loaded = _load(tmp_path, notes)[3]
    back = loaded.result()
    assert loaded.usage() == played.usage
    assert notes == []
    assert back.seen_P == played.seen_P and back.usage == played.usage
    assert back.problems_P == played.problems_P
    for group_a, group_b in zip(back.episodes_P, played.episodes_P, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a.final_reward == b.final_reward
            for turn_a, turn_b in zip(a.turns, b.turns, strict=True):
                for field in attrs.fields(Turn):
                    assert np.array_equal(
                        getattr(turn_a, field.name), getattr(turn_b, field.name)
                    ), field.name


def test_a_failed_job_and_the_steps_after_it_are_left_to_resample(tmp_path: Path):
    jobs: dict[int, Any] = {
        3: _Job(3, 5, _completions(0)),
        4: _Job(4, 6, None, fails=True),
        5: _Job(5, 6, _completions(2)),
    }
    _save(tmp_path, jobs)
    assert sorted(_load(tmp_path, [])) == [3]


def test_another_checkpoints_file_is_not_used(tmp_path: Path):
    _save(tmp_path, {3: _Job(3, 5, _completions(0))})
    notes: list[str] = []
    loaded = _load(tmp_path, notes, state_path=f"local://{tmp_path}/backend/other/step-000003")
    assert loaded == {}
    assert "belongs to another checkpoint of step 3" in notes[0]
    assert "steps 4..5 are sampled from the weights of step 3" in notes[0]


def test_a_moved_run_directory_still_matches(tmp_path: Path):
    (tmp_path / "a").mkdir()
    _save(tmp_path / "a", {3: _Job(3, 5, _completions(0))})
    (tmp_path / "a").rename(tmp_path / "b")
    notes: list[str] = []
    loaded = _load(tmp_path / "b", notes)
    assert notes == [] and sorted(loaded) == [3]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda text: text[: len(text) // 2], "is not valid JSON"),
        (lambda text: text.replace('"tokens"', '"tokenz"'), "does not match its checksum"),
        (
            lambda text: text.replace('"stop_reason": "stop"', '"stop_reason": 3'),
            "does not match its checksum",
        ),
    ],
)
def test_a_damaged_file_is_named_and_the_steps_resample(tmp_path: Path, damage: Any, message: str):
    _save(tmp_path, {3: _Job(3, 5, _completions(0))})
    path = ahead_path(tmp_path, 3)
    path.write_text(damage(path.read_text()))
    notes: list[str] = []
    assert _load(tmp_path, notes) == {}
    assert str(path) in notes[0] and message in notes[0], notes


def test_other_problems_or_too_stale_rollouts_are_not_used(tmp_path: Path):
    _save(tmp_path, {3: _Job(3, 5, _completions(0))})  # 1 update behind
    notes: list[str] = []
    assert _load(tmp_path, notes, seed=SEED + 1) == {}
    assert "problems differ" in notes[0]
    assert _load(tmp_path, [], max_steps_off_policy=0) == {}  # resumed with a smaller K
    assert _load(tmp_path, [], steps=3) == {}  # step 3 is past the run's end


def test_a_missing_file_says_the_steps_resample(tmp_path: Path):
    notes: list[str] = []
    assert _load(tmp_path, notes) == {}
    assert "no rollouts sampled ahead were saved with the checkpoint of step 3" in notes[0]


def test_prune_keeps_only_the_current_checkpoints_file(tmp_path: Path):
    for step in (1, 3):
        save_ahead(tmp_path, step, "local://x", {step: _Job(step, 0, _completions(step))}, 0)
    prune_ahead(tmp_path, 3)
    assert [path.name for path in (tmp_path / "ahead").iterdir()] == ["step-000003.json"]
    assert json.loads(ahead_path(tmp_path, 3).read_text())["step"] == 3


def test_rollouts_edited_by_hand_are_not_trusted(tmp_path: Path):
    import json

    _save(tmp_path, {3: _Job(3, 5, _completions(0))})
    path = ahead_path(tmp_path, 3)
    original = json.loads(path.read_text())
    for edit in ("text", "logprobs"):
        payload = json.loads(json.dumps(original))
        completion = payload["jobs"][0]["completions"][0][0]
        completion[edit] = "\\boxed{42}" if edit == "text" else [0.0] * 4
        path.write_text(json.dumps(payload))
        notes: list[str] = []
        assert _load(tmp_path, notes) == {}
        assert "does not match its checksum (edited or damaged" in notes[0], notes
    payload = dict(original)
    del payload["checksum"]
    path.write_text(json.dumps(payload))
    assert _load(tmp_path, []) == {}
    path.write_text(json.dumps(original))
    assert sorted(_load(tmp_path, [])) == [3]
