"""TensorBoard (`--log-to tensorboard`): event files in the run directory's
``trackers/tensorboard/``, written by torch's SummaryWriter (needs `pip install
'grpo[tensorboard]'`); no network, no account.

Every metric is a scalar under its metrics.jsonl name at its step. A resumed run opens the
writer with ``purge_step`` = the checkpoint's step + 1: TensorBoard then drops the events
the interrupted launch wrote after the checkpoint, and the redone steps replace them, as in
metrics.jsonl; a run that starts over (no checkpoint) removes the earlier event files, as
its metrics.jsonl is emptied. Events are flushed after every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from grpo.training.trackers.base import ConfigValues, PackageTracker, RunInfo


class TensorboardTracker(PackageTracker):
    """The TensorBoard mirror of metrics.jsonl."""

    name = "tensorboard"
    rewinds = True

    def open(
        self, package: ModuleType, run: RunInfo, config: ConfigValues, resume_step: int | None
    ) -> str | None:
        """A SummaryWriter on ``trackers/tensorboard``, purging the steps after a resume's."""
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run.tracker_dir(self.name)
        earlier = sorted(log_dir.glob("events.out.tfevents.*"))
        if resume_step is None:
            for events in earlier:  # a run started over: its metrics.jsonl was emptied too
                events.unlink()
            earlier = []
        purge_step = resume_step + 1 if earlier and resume_step is not None else None
        self._handle = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if purge_step is None:
            lines = [f"    {key} = {value!r}" for key, value in sorted(config.items())]
            tags = ", ".join(run.tags)
            header = f"run {run.run_name}, project {run.project}, tags {tags}"
            if run.group:
                header += f", experiment {run.group}"
            self._handle.add_text("config", header + "\n\n" + "\n".join(lines), global_step=0)
        return None

    def log(
        self, step: int, metrics: Mapping[str, float], texts: Sequence[tuple[str, str]]
    ) -> None:
        """Each metric as a scalar at ``step``, flushed."""
        for key, value in metrics.items():
            self._handle.add_scalar(key, value, global_step=step)
        self._handle.flush()

    def close(self, handle: Any) -> None:
        """Close the writer."""
        handle.close()
