"""SwanLab (`--log-to swanlab`, the default): `--swanlab-mode` online, offline or disabled.

Online falls back to offline (logs in the run directory's ``swanlog/``), with one line. Each
launch is a SwanLab experiment of its own (append-only: a resumed run's steps that SwanLab
already holds are not sent again). The logged rollout groups go as SwanLab text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType

from grpo.training.trackers.base import ConfigValues, PackageTracker, RunInfo, TrackerUnavailable


class SwanlabTracker(PackageTracker):
    """The SwanLab mirror of metrics.jsonl."""

    name = "swanlab"
    install = "pip install swanlab"

    def open(
        self, package: ModuleType, run: RunInfo, config: ConfigValues, resume_step: int | None
    ) -> str | None:
        """``swanlab.init`` in --swanlab-mode, online falling back to offline."""
        mode = run.swanlab_mode
        failures = []
        for attempt in (mode, "offline") if mode == "online" else (mode,):
            try:
                package.init(
                    project=run.project,
                    experiment_name=run.run_name,
                    config=dict(config),
                    mode=attempt,
                    logdir=str(run.run_dir / "swanlog"),
                )
            except Exception as error:  # noqa: BLE001 - the next mode, or one line
                failures.append(f"{attempt}: {error}")
                continue
            self._handle = package
            if attempt != mode:
                return f"SwanLab online failed ({failures[0]}); logging offline to swanlog/"
            return None
        raise TrackerUnavailable(f"SwanLab init failed ({'; '.join(failures)})")

    def log(
        self, step: int, metrics: Mapping[str, float], texts: Sequence[tuple[str, str]]
    ) -> None:
        """``swanlab.log`` of the metrics, and the rollout groups as ``swanlab.Text``."""
        payload: dict[str, object] = dict(metrics)
        if texts:
            payload["rollouts"] = [
                self._handle.Text(text, caption=caption) for caption, text in texts
            ]
        self._handle.log(payload, step=step)
