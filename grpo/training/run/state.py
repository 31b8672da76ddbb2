"""The records a run carries through its steps: ``Run`` (fixed) and ``RunState`` (changing).

`grpo.training.recipes.grpo.run` builds them once a run's checks have passed; every step of a recipe
(`grpo.training.recipes`) reads the first and advances the second; the lifecycle
(`grpo.training.run.lifecycle`) keeps the progress fields of the second for every recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
from pytrio.types import AdamParams, Datum

from grpo.backends.clients import TrainingClient
from grpo.core.usage import Prices, TokenUsage
from grpo.rewards.judges import Judge
from grpo.training.recipes.distill.teacher import Teacher
from grpo.training.rollouts.clients import Sampler, Tokenizer
from grpo.training.rollouts.grading import Job
from grpo.training.rollouts.problems import Problem
from grpo.training.run.run_log import RolloutRecord, RunLogger
from grpo.training.settings.config import TrainConfig


@attrs.frozen
class Run:
    """What stays fixed during a run: the config, clients, problems and sinks."""

    config: TrainConfig
    run_dir: Path
    steps: int
    training_client: TrainingClient
    tokenizer: Tokenizer
    train_problems: list[Problem]
    test_problems: list[Problem]
    adam: AdamParams
    pool: ThreadPoolExecutor
    ref_sampler: Sampler | None
    logger: RunLogger
    note: Callable[[str], None]
    prices: Prices | None = None
    teacher: Teacher | None = None
    """The checked teacher of `grpo distill` (`grpo.training.recipes.distill.teacher.Teacher`), else
    None."""
    judge: Judge | None = None
    """The judge of the judge rewards (`grpo.rewards.judges.Judge`), else None."""
    service_normalization: str = "sum"
    """What the service divides a loss's gradient by (`grpo.core.normalization.service_divisor`):
    the learner pre-scales its datums for it."""


@attrs.define
class RunState:
    """What changes during a run: progress, the sampler cache and in-flight rollouts."""

    completed: int
    """The last step whose row is on disk (the step a checkpoint of these weights covers)."""
    last_saved_step: int
    version: int
    """Updates applied, at batch granularity: one per trained step."""
    weights_dirty: bool = False
    """True from the first optimizer step of a step until its row is logged."""
    probe_datums: list[Datum] | None = None
    """The last minibatch of an update no checkpoint has checked yet, stripped to targets: no
    checkpoint if its log-probs are not finite (None once checked)."""
    sampler: Sampler | None = None
    sampler_version: int = -1
    jobs: dict[int, Job] = attrs.Factory(dict)
    """Sampling in flight, by step (steps ahead under --max-steps-off-policy): each a
    `grpo.training.rollouts.grading.Job`."""
    rollout_log: list[RolloutRecord] = attrs.Factory(list)
    """The groups of the step being trained, for rollouts.jsonl (written with its row)."""
    last_metrics: dict[str, float] = attrs.Factory(dict)
    usage: TokenUsage = TokenUsage()
    """Tokens used since the last logged row (they go into the next one)."""
    usage_logged: TokenUsage = TokenUsage()
    """Tokens of every logged row, cumulative (``usage/cum_*`` of the last row)."""
