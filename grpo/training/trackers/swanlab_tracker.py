"""SwanLab (`--log-to swanlab`, the default): `--swanlab-mode` online, offline or disabled.

Online falls back to offline (logs in the run directory's ``swanlog/``), with one line. Each
launch is a SwanLab experiment of its own (append-only: a resumed run's steps that SwanLab
already holds are not sent again). The logged rollout groups go as SwanLab text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo.training.trackers.base import RunInfo, TrackerUnavailable, import_extra


class SwanlabTracker:
    """The SwanLab mirror of metrics.jsonl."""

    name = "swanlab"
    rewinds = False

    def __init__(self) -> None:
        self._swanlab: Any = None

    def start(
        self, run: RunInfo, config: Mapping[str, object], resume_step: int | None
    ) -> str | None:
        """``swanlab.init`` in --swanlab-mode, online falling back to offline."""
        swanlab = import_extra("swanlab", "pip install swanlab")
        mode = run.swanlab_mode
        failures = []
        for attempt in (mode, "offline") if mode == "online" else (mode,):
            try:
                swanlab.init(
                    project=run.project,
                    experiment_name=run.run_name,
                    config=dict(config),
                    mode=attempt,
                    logdir=str(run.run_dir / "swanlog"),
                )
            except Exception as error:  # noqa: BLE001 - the next mode, or one line
                failures.append(f"{attempt}: {error}")
                continue
            self._swanlab = swanlab
            if attempt != mode:
                return f"SwanLab online failed ({failures[0]}); logging offline to swanlog/"
            return None
        raise TrackerUnavailable(f"SwanLab init failed ({'; '.join(failures)})")

    def held_through(self) -> int | None:
        """Unknown from SwanLab itself: the fan-out's own record says."""
        return None

    def log(
        self, step: int, metrics: Mapping[str, float], texts: Sequence[tuple[str, str]]
    ) -> None:
        """``swanlab.log`` of the metrics, and the rollout groups as ``swanlab.Text``."""
        payload: dict[str, object] = dict(metrics)
        if texts:
            payload["rollouts"] = [
                self._swanlab.Text(text, caption=caption) for caption, text in texts
            ]
        self._swanlab.log(payload, step=step)

    def finish(self) -> None:
        """``swanlab.finish``."""
        if self._swanlab is not None:
            swanlab, self._swanlab = self._swanlab, None
            swanlab.finish()
