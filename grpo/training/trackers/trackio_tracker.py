"""Trackio (`--log-to trackio`; `pip install 'grpo[trackio]'`): Hugging Face's local-first
tracker. Metrics go to Trackio's local database (``TRACKIO_DIR``, by default under
~/.cache/huggingface/trackio; `trackio show` opens its dashboard), or to a Space when
``TRACKIO_SPACE_ID`` is set, as Trackio itself decides.

A resumed grpo run continues the Trackio run of the same name (``resume="allow"``; a
`grpo compare`/`sweep` run is named ``<experiment>-<run name>``, so runs of two
experiments never share one);
Trackio is append-only here, so the steps it already holds (its local store's last step
for the run) are not sent again (`grpo.training.trackers.fanout`). Trackio's CPU/GPU
sampling is off.
"""

from __future__ import annotations

from types import ModuleType

from grpo.training.trackers.base import ConfigValues, PackageTracker, RunInfo


def trackio_name(run: RunInfo) -> str:
    """The Trackio run name: ``<experiment>-<run name>`` in a group (Trackio resumes a run
    by name, and two experiments' runs may share one), else the run name."""
    return f"{run.group}-{run.run_name}" if run.group else run.run_name


class TrackioTracker(PackageTracker):
    """The Trackio mirror of metrics.jsonl."""

    name = "trackio"

    def open(
        self, package: ModuleType, run: RunInfo, config: ConfigValues, resume_step: int | None
    ) -> str | None:
        """``trackio.init`` of the run (continued when resuming)."""
        self._handle = package.init(
            project=run.project,
            name=trackio_name(run),
            group=run.group,
            config={**config, "tags": list(run.tags)},
            resume="allow" if resume_step is not None else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        self._held = -1
        if resume_step is not None:
            self._held = self._stored_last_step(run.project, str(self._handle.id))
        return None

    @staticmethod
    def _stored_last_step(project: str, run_id: str) -> int | None:
        """The last step Trackio's local store holds for run ``run_id`` (None: it cannot
        tell)."""
        try:
            from trackio.sqlite_storage import SQLiteStorage

            last = SQLiteStorage.get_max_step_for_run(project, run_id=run_id)
        except Exception:  # noqa: BLE001 - a Space, or another store: the fan-out's record
            return None
        return -1 if last is None else int(last)
