"""Rollouts sampled ahead, saved with a checkpoint so that a resumed run uses them.

Under ``--max-steps-off-policy K > 0`` the sampling of the next K steps is in flight when a
checkpoint is taken, on weights up to K updates older than the checkpoint's. A resumed run
cannot sample them again (those weights are gone), so ``save_ahead`` waits for them and
writes them to ``ahead/step-NNNNNN.json`` before the checkpoint record points at the
weights; ``load_ahead`` gives them back as finished jobs with the same staleness, and the
resumed run continues exactly as an uninterrupted one (docs/RELIABILITY.md).

A file is used only by the checkpoint it was written with (its state path is recorded), only
while its SHA-256 checksum matches (a file edited by hand is not trusted), and only while it
matches the run (the same problems at each step, staleness within K); else
the resumed run samples those steps again from the checkpoint's weights, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from grpo.core.episodes import Episode, Turn
from grpo.core.records import Completion
from grpo.core.usage import USAGE_KINDS, TokenUsage
from grpo.training.rollouts.grading import Job, JobResult, PlayedGroups
from grpo.training.rollouts.problems import Problem, step_problems
from grpo.training.run import run_files

AHEAD_DIR = "ahead"
_FORMAT = 1


@attrs.frozen
class ReadyJob:
    """A step's sampling that already finished: the interface of `RolloutJob`/`EpisodeJob`."""

    problems: tuple[Problem, ...]
    sampler_version: int
    outcome: JobResult
    """What the job's ``result()`` returned: completions per problem, or `PlayedGroups`."""
    tokens: TokenUsage

    def result(self) -> JobResult:
        """The finished job's result."""
        return self.outcome

    def usage(self) -> TokenUsage:
        """The tokens its requests sent and sampled."""
        return self.tokens

    def cancel(self) -> None:
        """Nothing is in flight."""


def ahead_path(run_dir: Path, step: int) -> Path:
    """Where the rollouts sampled ahead of checkpoint ``step`` are kept."""
    return run_dir / AHEAD_DIR / f"step-{step:06d}.json"


def save_ahead(
    run_dir: Path, step: int, state_path: str, jobs: dict[int, Job], version: int
) -> None:
    """Wait for the jobs in flight and write them for checkpoint ``step`` (atomically).

    Each becomes a `ReadyJob` in ``jobs`` (it is not waited for twice). A job that failed is
    left out, and so are the steps after it: a resumed run samples those again.
    """
    records = []
    for ahead in sorted(jobs):
        job = jobs[ahead]
        try:
            outcome = job.result()
        except Exception:  # noqa: BLE001 - its step fails or resamples when it is reached
            break
        usage = job.usage() if isinstance(outcome, list) else outcome.usage  # episodes: in it
        jobs[ahead] = ReadyJob(tuple(job.problems), job.sampler_version, outcome, usage)
        records.append(
            {
                "step": ahead,
                "behind": version - job.sampler_version,
                "problem_indices": [problem.index for problem in job.problems],
                "usage": {kind: getattr(usage, kind) for kind in USAGE_KINDS},
                **_outcome_record(outcome),
            }
        )
    path = ahead_path(run_dir, step)
    if records:
        path.parent.mkdir(exist_ok=True)
        payload = {
            "format": _FORMAT,
            "step": step,
            "state_path": run_files.stored_state_path(run_dir, state_path),
            "jobs": records,
        }
        checksum = run_files.payload_checksum(payload)  # it names the checkpoint's state path
        run_files.write_json_atomic(path, {**payload, "checksum": checksum})


def prune_ahead(run_dir: Path, step: int) -> None:
    """Remove the files of checkpoints other than ``step`` (once its record is written)."""
    keep = ahead_path(run_dir, step)
    for other in (run_dir / AHEAD_DIR).glob("step-*.json"):
        if other != keep:
            other.unlink(missing_ok=True)


def load_ahead(
    run_dir: Path,
    step: int,
    state_path: str,
    *,
    problems: Sequence[Problem],
    batch_size: int,
    seed: int,
    max_steps_off_policy: int,
    steps: int,
    version: int,
    note: Callable[[str], None],
) -> dict[int, ReadyJob]:
    """The jobs saved with checkpoint ``step`` that still fit the run, by step.

    ``version`` is the resumed run's update count: a job saved ``behind`` updates stale is
    given ``sampler_version = version - behind``, so its staleness is what it was.
    """
    path = ahead_path(run_dir, step)
    resample = (
        f"steps {step + 1}..{step + max_steps_off_policy} are sampled from the weights of step "
        f"{step} (fresher rollouts than an uninterrupted run would train on)"
    )
    try:
        payload = run_files.read_json(path, what="rollouts sampled ahead")
    except run_files.RunDirError as error:
        if path.exists():
            note(f"{error}; {resample}")
        else:
            note(
                f"no rollouts sampled ahead were saved with the checkpoint of step {step}; "
                f"{resample}"
            )
        return {}
    saved_with = run_files.stored_state_path(run_dir, state_path)
    if payload.get("format") != _FORMAT or payload.get("state_path") != saved_with:
        note(f"{path} belongs to another checkpoint of step {step}; {resample}")
        return {}
    checksum = payload.pop("checksum", None)
    if checksum != run_files.payload_checksum(payload):
        note(
            f"{path} does not match its checksum (edited or damaged since the checkpoint of "
            f"step {step} wrote it); {resample}"
        )
        return {}
    jobs: dict[int, ReadyJob] = {}
    try:
        for record in payload["jobs"]:
            ahead, behind = int(record["step"]), int(record["behind"])
            if ahead >= steps or not 0 <= behind <= max_steps_off_policy:
                continue
            batch = step_problems(problems, batch_size, ahead, seed)
            if [problem.index for problem in batch] != list(record["problem_indices"]):
                raise ValueError(f"step {ahead}'s problems differ from the ones sampled")
            usage = TokenUsage(**{kind: int(record["usage"].get(kind, 0)) for kind in USAGE_KINDS})
            outcome = _outcome(record, batch, usage)
            jobs[ahead] = ReadyJob(tuple(batch), version - behind, outcome, usage)
    except (KeyError, TypeError, ValueError) as error:
        note(f"{path} cannot be used ({type(error).__name__}: {error}); {resample}")
        return {}
    return jobs


# --- records -------------------------------------------------------------------------------


def _plain(value: object) -> object:
    """An attrs record's field as JSON: arrays as lists (floats round-trip exactly)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _fields(record: attrs.AttrsInstance) -> run_files.JsonObject:
    """Every field of an attrs record, as JSON values."""
    return {field.name: _plain(getattr(record, field.name)) for field in attrs.fields(type(record))}


def _outcome_record(outcome: JobResult) -> run_files.JsonObject:
    """A job's result as JSON: ``completions`` (single-turn) or ``episodes`` (--env)."""
    if isinstance(outcome, list):
        return {"completions": [[_fields(c) for c in group] for group in outcome]}
    return {
        "episodes": [
            [
                {
                    "turns": [_fields(turn) for turn in episode.turns],
                    "final_reward": episode.final_reward,
                }
                for episode in group
            ]
            for group in outcome.episodes_P
        ],
        "seen": [[list(seen) for seen in group] for group in outcome.seen_P],
    }


def _outcome(record: Mapping[str, Any], batch: list[Problem], usage: TokenUsage) -> JobResult:
    """The job's result back from its record (the validators of each record check it)."""
    if "completions" in record:
        groups = [[Completion(**c) for c in group] for group in record["completions"]]
        if len(groups) != len(batch):
            raise ValueError(f"{len(groups)} groups for {len(batch)} problems")
        return groups
    episodes = tuple(
        tuple(
            Episode(
                turns=tuple(Turn(**turn) for turn in episode["turns"]),
                final_reward=episode["final_reward"],
            )
            for episode in group
        )
        for group in record["episodes"]
    )
    seen = tuple(tuple(tuple(str(text) for text in s) for s in group) for group in record["seen"])
    if not len(episodes) == len(seen) == len(batch):
        raise ValueError(f"{len(episodes)} groups for {len(batch)} problems")
    return PlayedGroups(problems_P=tuple(batch), episodes_P=episodes, seen_P=seen, usage=usage)
