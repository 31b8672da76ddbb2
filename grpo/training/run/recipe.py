"""The seam between a recipe and the run lifecycle: what a recipe does, what a run is.

`grpo.training.run.lifecycle` runs any ``Recipe``: it owns the run directory, the lock, resume,
the step loop, signals, checkpoints, usage and the summary; a recipe says what one step
does (sample or read data, score: task reward, teacher or labels, build datums, update), how
it evaluates, and what it keeps beside a checkpoint. The recipes are in
`grpo.training.recipes`: ``grpo`` (GRPO and on-policy distillation, on completions or
episodes) and ``sft``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypedDict

import attrs

from grpo.backends.clients import ServiceClient, TrainingClient
from grpo.core.usage import Prices
from grpo.training.run.run_files import JsonObject
from grpo.training.run.run_log import RunLogger
from grpo.training.run.state import RunState


@attrs.frozen
class Session:
    """What the lifecycle needs of any run: its directory, client, sinks and step count."""

    run_dir: Path
    run_name: str
    steps: int
    training_client: TrainingClient
    logger: RunLogger
    note: Callable[[str], None]
    prices: Prices | None
    max_retries: int


class DryRunOptions(TypedDict, total=False):
    """How a recipe's dry run is launched beside its config, ``dry_run(config, **options)``:
    planning the continuation of its run directory (``resume``, default False), on a given
    service (``service_client``, default: one made from its flags)."""

    resume: bool
    service_client: ServiceClient | None


class RunOptions(DryRunOptions, total=False):
    """How a recipe's run is launched beside its config, ``run(config, **options)``: as a dry
    run's (``resume`` continues its run directory), writing its lines to ``echo`` (default
    print), with a progress bar (``progress``, default True)."""

    echo: Callable[[str], None]
    progress: bool


class Recipe(Protocol):
    """One training recipe as the lifecycle drives it (steps are numbered from 0; ``done`` is
    the number of steps finished, the number a row is logged under)."""

    session: Session
    command: str
    """The CLI command that resumes the run (``train``, ``sft``): named in stop messages."""
    progress_label: str
    steps_word: str
    """How the closing line counts steps (``steps``, ``SFT steps``)."""

    def step(self, state: RunState, step: int) -> dict[str, float]:
        """Train step ``step``; its metrics, not yet logged."""
        ...

    def evaluates_after(self, done: int) -> bool:
        """Whether an evaluation follows step ``done`` (0: the baseline row, before training)."""
        ...

    def evaluate(self, state: RunState) -> dict[str, float]:
        """The evaluation of the current weights (its usage into ``state.usage``)."""
        ...

    def baseline(self, state: RunState) -> dict[str, float]:
        """Row 0: the evaluation before training, with what the recipe measures once."""
        ...

    def saves_after(self, done: int) -> bool:
        """A periodic checkpoint after step ``done`` (before the last; the last is ``final``)."""
        ...

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """The step's line on the terminal."""
        ...

    def save_beside(self, state: RunState, state_path: str) -> None:
        """Write what must go with the checkpoint of ``state_path`` (before it is recorded)."""
        ...

    def saved(self, state: RunState) -> None:
        """The checkpoint of ``state.completed`` is recorded: drop what only older ones need."""
        ...

    def calls(self, stop: threading.Event) -> contextlib.AbstractContextManager[object]:
        """The context the steps run in (reward workers, until ``stop`` is set)."""
        ...

    def summary(self, state: RunState) -> JsonObject:
        """The recipe's keys of summary.json."""
        ...

    def close(self, state: RunState) -> None:
        """Cancel what is in flight and release pools (after the last step or a stop)."""
        ...
