"""Every `--log-to` tracker of a run, each on a thread of its own, each step exactly once.

Training only enqueues: a tracker that is slow to start (W&B), hangs (no network) or raises
never slows or stops a step. A tracker that fails is reported in one line and dropped; the
others and metrics.jsonl go on. Each tracker's queue holds at most `QUEUE_STEPS` steps; a
tracker that falls that far behind is dropped the same way. `close` waits at most
`FINISH_TIMEOUT_S` for every tracker to flush.

Exactly once, across a kill and a resume, as metrics.jsonl: what a tracker holds is what
its own store says (`Tracker.held_through`: W&B's offline files or resumed run, Trackio's
database), else `trackers/<name>.json` in the run directory, which records the last step
each tracker took. On a resume from checkpoint step k (metrics.jsonl then holds exactly
the rows of steps <= k):

- the rows of metrics.jsonl a tracker missed (a kill while its queue was not empty, or a
  tracker that was dropped) are sent first, so it holds every step up to k;
- a tracker that rewinds (TensorBoard: it purges the steps after k) gets steps k+1.. again,
  as metrics.jsonl does;
- an append-only tracker (W&B, Trackio, SwanLab) keeps the steps after k it already holds
  and gets only the later ones, so none is logged twice.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.training.run.run_files import STEP_KEY, write_json_atomic
from grpo.training.trackers.base import TRACKER_NAMES, TRACKERS_DIR, RunInfo, Tracker

QUEUE_STEPS = 1000
"""Steps a tracker may fall behind before it is dropped for the rest of the launch."""

FINISH_TIMEOUT_S = 30.0
"""The longest `close` waits for the trackers to flush (all of them together)."""

_FINISH = object()


def make_tracker(name: str) -> Tracker:
    """Tracker ``name`` (one of TRACKER_NAMES but `none`); its package is imported only at
    `start`, so asking for a tracker that is not installed fails there, with one line."""
    if name == "swanlab":
        from grpo.training.trackers.swanlab_tracker import SwanlabTracker

        return SwanlabTracker()
    if name == "wandb":
        from grpo.training.trackers.wandb_tracker import WandbTracker

        return WandbTracker()
    if name == "tensorboard":
        from grpo.training.trackers.tensorboard_tracker import TensorboardTracker

        return TensorboardTracker()
    if name == "trackio":
        from grpo.training.trackers.trackio_tracker import TrackioTracker

        return TrackioTracker()
    raise ValueError(f"no tracker named {name!r}; --log-to takes {', '.join(TRACKER_NAMES)}")


def chartable(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics a tracker charts: finite numbers (metrics.jsonl writes the rest as null)."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


class _TrackerThread:
    """One tracker fed from a bounded queue by a daemon thread."""

    def __init__(
        self,
        tracker: Tracker,
        run: RunInfo,
        config: Mapping[str, object],
        resume_step: int,
        replay_rows: Sequence[Mapping[str, object]],
        note: Callable[[str], None],
    ) -> None:
        self.name = tracker.name
        self._tracker, self._run, self._config = tracker, run, config
        self._resume_step, self._replay_rows, self._note = resume_step, replay_rows, note
        self._state_path = run.run_dir / TRACKERS_DIR / f"{tracker.name}.json"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_STEPS)
        self.dropped = False
        self._thread = threading.Thread(
            target=self._serve, name=f"tracker-{tracker.name}", daemon=True
        )
        self._thread.start()

    def put(self, step: int, metrics: dict[str, float], texts: list[tuple[str, str]]) -> None:
        """Queue one step (never blocks); a tracker too far behind is dropped with one line."""
        if self.dropped:
            return
        try:
            self._queue.put_nowait((step, metrics, texts))
        except queue.Full:
            self._drop(f"is {QUEUE_STEPS} steps behind")

    def ask_to_finish(self) -> None:
        """Queue the finish after the steps already queued (never blocks); a dropped tracker
        is finished too once its thread gets there (it sends nothing more)."""
        try:
            self._queue.put_nowait(_FINISH)
        except queue.Full:
            if not self.dropped:
                self._drop("did not take its last steps in time")

    def wait(self, deadline: float) -> None:
        """Wait for the tracker to finish until ``deadline`` (time.monotonic)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and not self.dropped:
            self._drop(
                f"did not finish within {FINISH_TIMEOUT_S:.0f} s; its last steps may be missing"
            )

    def _drop(self, why: str) -> None:
        self.dropped = True
        self._note(f"{self.name} {why}; logging to the other trackers and metrics.jsonl")

    def _held_through(self) -> int:
        """The last step this tracker holds, as its state file says (-1 when it holds none:
        a run may log a baseline row at step 0)."""
        if self._resume_step == 0:
            return -1
        try:
            held = json.loads(self._state_path.read_text(encoding="utf-8"))["held_through"]
        except (OSError, ValueError, KeyError, TypeError):
            return -1
        held = held if isinstance(held, int) and not isinstance(held, bool) else -1
        return min(held, self._resume_step) if self._tracker.rewinds else held

    def _send(self, step: int, metrics: dict[str, float], texts: list[tuple[str, str]]) -> None:
        self._tracker.log(step, metrics, texts)
        write_json_atomic(self._state_path, {"held_through": step})

    def _serve(self) -> None:
        try:
            held = self._held_through()
            line = self._tracker.start(self._run, self._config, self._resume_step or None)
            if line:
                self._note(line)
            own = self._tracker.held_through()
            if own is not None and not self._tracker.rewinds:
                held = own
            for row in self._replay_rows if self._resume_step > 0 else ():
                if held < row[STEP_KEY] <= self._resume_step:
                    metrics = {key: value for key, value in row.items() if key != STEP_KEY}
                    self._send(row[STEP_KEY], chartable(metrics), [])
            while (item := self._queue.get()) is not _FINISH:
                step, metrics, texts = item
                if step > held and not self.dropped:
                    self._send(step, metrics, texts)
            self._tracker.finish()
        except Exception as error:  # noqa: BLE001 - a tracker never stops training
            if not self.dropped:
                self._drop(f"failed ({type(error).__name__}: {_one_line(error)})")
            _quietly(self._tracker.finish)


def _one_line(error: BaseException) -> str:
    """An error's message on one line, cut at 300 characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - already reported; closing what is left
        pass


class TrackerSet:
    """The trackers of one launch: `log` queues a step for each, `close` flushes them."""

    def __init__(
        self,
        names: Sequence[str],
        run: RunInfo,
        config: Mapping[str, object],
        *,
        resume_step: int,
        replay_rows: Sequence[Mapping[str, object]],
        note: Callable[[str], None],
        factory: Callable[[str], Tracker] | None = None,
    ) -> None:
        factory = factory or make_tracker
        wanted = [name for name in dict.fromkeys(names) if name != "none"]
        if wanted:
            (run.run_dir / TRACKERS_DIR).mkdir(exist_ok=True)
        self._threads = [
            _TrackerThread(factory(name), run, config, resume_step, replay_rows, note)
            for name in wanted
        ]

    @property
    def names(self) -> list[str]:
        """The trackers still receiving steps."""
        return [thread.name for thread in self._threads if not thread.dropped]

    def log(
        self, step: int, metrics: Mapping[str, object], texts: Sequence[tuple[str, str]]
    ) -> None:
        """Queue ``step``'s chartable metrics (and rollout texts) for every tracker."""
        numbers, captioned = chartable(metrics), list(texts)
        for thread in self._threads:
            thread.put(step, numbers, captioned)

    def close(self) -> None:
        """Finish every tracker, waiting at most FINISH_TIMEOUT_S for all of them."""
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        for thread in self._threads:
            thread.ask_to_finish()
        for thread in self._threads:
            thread.wait(deadline)
