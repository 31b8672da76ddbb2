"""Metrics rows from TensorBoard event files, for `grpo plot` on a run that has no
metrics.jsonl (a TRL or other trainer's `--report_to tensorboard` directory, or a copy of a
grpo run's ``trackers/tensorboard/``).

Read with TensorBoard's own `EventAccumulator` (`pip install 'grpo[tensorboard]'`), which
honours purged steps, as TensorBoard shows them: one row per step, each scalar tag a key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EVENT_GLOB = "events.out.tfevents.*"


def event_directory(path: Path) -> Path | None:
    """The one directory at or under ``path`` holding event files; None when there is none;
    ValueError naming them when there are several (a log dir of several runs)."""
    directories = sorted({event.parent for event in path.rglob(EVENT_GLOB) if event.is_file()})
    if not directories:
        return None
    if len(directories) > 1:
        listed = ", ".join(str(directory) for directory in directories[:5])
        raise ValueError(
            f"{path} holds TensorBoard event files of {len(directories)} runs ({listed}); "
            "pass one of those directories"
        )
    return directories[0]


def read_event_rows(directory: Path) -> list[dict[str, Any]]:
    """One row per step of the scalars in ``directory``'s event files, in step order."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ValueError(
            f"{directory} holds TensorBoard event files; reading them needs tensorboard: "
            "pip install 'grpo[tensorboard]'"
        ) from None
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    rows: dict[int, dict[str, Any]] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            rows.setdefault(event.step, {"step": event.step})[tag] = float(event.value)
    if not rows:
        raise ValueError(f"{directory}: its TensorBoard event files hold no scalars to plot")
    return [rows[step] for step in sorted(rows)]
