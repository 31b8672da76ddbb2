"""The tracker seam: what every experiment tracker (`--log-to`) is given and must do.

A tracker mirrors `metrics.jsonl` (the record of truth) into a tool people already look at.
It is started once per launch with the run's identity, its resolved config (secrets already
scrubbed) and the step a resumed run continues from; then it gets each step's metrics under
the names metrics.jsonl uses, at that step; then it is finished. `grpo.training.trackers.fanout`
runs each one on a thread of its own, so a slow or broken tracker never slows or stops training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TypeAlias

import attrs

TRACKER_NAMES = ("swanlab", "wandb", "tensorboard", "trackio", "none")
"""The values of --log-to; `none` alone logs to metrics.jsonl only."""

ConfigValues: TypeAlias = "Mapping[str, object]"
"""A run's resolved config as a tracker is given it (secrets already scrubbed)."""

TRACKERS_DIR = "trackers"
"""The run directory's folder for the trackers' own files (W&B's, TensorBoard's, Trackio's)."""


@attrs.frozen
class RunInfo:
    """Who a run is, as every tracker names it."""

    run_dir: Path
    run_name: str
    project: str
    group: str | None
    """The experiment a `grpo compare`/`grpo sweep` run belongs to (None for a lone run)."""
    tags: tuple[str, ...]
    swanlab_mode: str

    def tracker_dir(self, name: str) -> Path:
        """The folder of tracker ``name``'s own files inside the run directory (created)."""
        path = self.run_dir / TRACKERS_DIR / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class Tracker(Protocol):
    """An experiment tracker; any method may raise (the fan-out turns that into one line)."""

    name: str
    rewinds: bool
    """True when starting at ``resume_step`` drops what the tracker holds after that step
    (TensorBoard's purge), so the redone steps are sent again; False for append-only trackers
    (W&B, Trackio, SwanLab), which keep the steps they already hold."""

    def start(
        self, run: RunInfo, config: Mapping[str, object], resume_step: int | None
    ) -> str | None:
        """Open (or, with ``resume_step``, continue) this run's tracker run; a line to show
        the user (a fallback taken), or None."""

    def held_through(self) -> int | None:
        """After `start`: the last step the tracker's own store holds for this run (-1 for
        none), or None when it cannot tell (the fan-out's own record is used)."""

    def log(
        self, step: int, metrics: Mapping[str, float], texts: Sequence[tuple[str, str]]
    ) -> None:
        """Record one step's metrics (and its rollouts as (caption, text)) at ``step``."""

    def finish(self) -> None:
        """Flush and close the tracker run."""


class PackageTracker:
    """What every tracker shares: ``start`` imports its package, named as the tracker (when
    missing, TrackerUnavailable saying how to install it) and hands it to ``open``, which
    keeps its handle (the tracker's run, a writer, the package itself) in ``_handle``;
    ``finish`` closes that handle once (``close``: ``handle.finish()`` unless overridden);
    ``log`` is ``handle.log`` of each step (W&B's, Trackio's); the last step the tracker's
    store holds is unknown (None: the fan-out's own record says) unless ``open`` sets
    ``_held``."""

    name: str
    rewinds = False
    install = ""
    """How to install its package when it is missing (default: the grpo extra of its name,
    pyproject.toml)."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._held: int | None = None

    def start(
        self, run: RunInfo, config: Mapping[str, object], resume_step: int | None
    ) -> str | None:
        """Import the tracker's package, then ``open`` this run's tracker run; its line."""
        install = self.install or f"pip install 'grpo[{self.name}]'"
        return self.open(import_extra(self.name, install), run, config, resume_step)

    def open(
        self, package: ModuleType, run: RunInfo, config: ConfigValues, resume_step: int | None
    ) -> str | None:
        """Open (or, with ``resume_step``, continue) the tracker run with ``package``, keeping
        its handle in ``_handle``; a line to show the user (a fallback taken), or None."""
        raise NotImplementedError

    def held_through(self) -> int | None:
        """The last step the tracker's store holds for this run (-1: none; None: unknown)."""
        return self._held

    def log(
        self, step: int, metrics: Mapping[str, float], texts: Sequence[tuple[str, str]]
    ) -> None:
        """``handle.log`` of the metrics at ``step``."""
        self._handle.log(dict(metrics), step=step)

    def finish(self) -> None:
        """Close the handle once (flushing what the tracker buffered)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self.close(handle)

    def close(self, handle: Any) -> None:
        """``handle.finish()``."""
        handle.finish()


class TrackerUnavailable(RuntimeError):
    """A tracker that cannot start here (its package is missing, or it refused to start)."""


def import_extra(module: str, install: str) -> ModuleType:
    """``import module``, or TrackerUnavailable saying how to ``install`` it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackerUnavailable(f"{module} is not installed ({error}); {install}") from None
