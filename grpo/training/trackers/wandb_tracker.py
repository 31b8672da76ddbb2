"""Weights & Biases (`--log-to wandb`; `pip install 'grpo[wandb]'`), offline first.

The mode is W&B's own ``WANDB_MODE`` when set; otherwise online when W&B has a login
(``WANDB_API_KEY`` or a ``wandb login`` entry in ~/.netrc), else offline. Offline runs live
under the run directory's ``trackers/wandb/`` (W&B's ``dir``) and upload later with
``wandb sync runs/<name>/trackers/wandb/wandb/offline-run-*``. An online start that fails (no
network) falls back to offline, with one line. W&B's console capture, system statistics,
git probing and code saving are off: the run's config.json and metrics are what it gets.

The W&B run id is kept in ``trackers/wandb/run-id``, so a resumed grpo run continues the
same W&B run (``resume="allow"``). W&B's history is append-only: the steps it already
holds are not sent again (`grpo.training.trackers.fanout`). What it holds is read from W&B
itself: online, the resumed run's starting step; offline, the history records in the
earlier launches' ``.wandb`` files (written every `FLUSH_INTERVAL_S`, so a kill -9 can lose
the last seconds: the resume sends those steps again from metrics.jsonl). The API key is W&B's own
business: grpo never reads, logs or stores it.
"""

from __future__ import annotations

import netrc
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo.training.trackers.base import ConfigValues, PackageTracker, RunInfo

RUN_ID_FILE = "run-id"
INIT_TIMEOUT_S = 60.0
FLUSH_INTERVAL_S = 2.0
"""How often W&B writes the run's ``.wandb`` file (its default is 15 s): what a kill loses."""


def has_login() -> bool:
    """Whether W&B would find an API key (the variable, or a ~/.netrc entry); never reads it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _records(path: Path) -> Iterator[bytes]:
    """The payloads of a ``.wandb`` file: W&B's 7-byte header, then LevelDB log records
    (32 KiB blocks; each chunk has a 7-byte header: CRC, length, type; types 1 FULL, 2
    FIRST, 3 MIDDLE, 4 LAST). A cut-off tail (a killed writer) ends the iteration."""
    data, position, payload = path.read_bytes(), 7, b""
    block = 32768
    while position + 7 <= len(data):
        left_in_block = block - position % block
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        if left_in_block < 7 or (length == 0 and kind == 0):
            position += left_in_block  # the block's zero padding
            continue
        if position + 7 + length > len(data):
            return
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield payload
            payload = b""


def offline_last_step(wandb_dir: Path, run_id: str) -> int:
    """The last history step of W&B run ``run_id`` in the offline runs under ``wandb_dir``
    (-1 when none holds one)."""
    from wandb.proto import wandb_internal_pb2

    last = -1
    for path in wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"):
        for payload in _records(path):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - a damaged record: what follows is unknown
                break
            if record.WhichOneof("record_type") == "history":
                last = max(last, record.history.step.num)
    return last


class WandbTracker(PackageTracker):
    """The W&B mirror of metrics.jsonl."""

    name = "wandb"

    def open(
        self, package: ModuleType, run: RunInfo, config: ConfigValues, resume_step: int | None
    ) -> str | None:
        """``wandb.init`` of this grpo run's W&B run (a new id for a new run)."""
        directory = run.tracker_dir(self.name)
        id_file = directory / RUN_ID_FILE
        if resume_step is None or not id_file.is_file():
            id_file.write_text(secrets.token_hex(4), encoding="utf-8")
        run_id = id_file.read_text(encoding="utf-8").strip()
        wanted = os.environ.get("WANDB_MODE") or ("online" if has_login() else "offline")
        held_offline = offline_last_step(directory, run_id) if resume_step is not None else -1
        line = None
        try:
            self._handle = self._init(package, run, config, run_id, wanted, directory)
        except Exception as error:  # noqa: BLE001 - online failed: offline, said once
            if wanted == "offline":
                raise
            self._handle = self._init(package, run, config, run_id, "offline", directory)
            line = f"W&B {wanted} failed ({error}); logging offline to {directory}"
        if self._handle.offline:
            self._held = held_offline
            if line is None and resume_step is None:
                line = f"W&B logs offline to {directory} (upload later with `wandb sync`)"
        else:
            self._held = max(held_offline, int(self._handle.starting_step) - 1)
        return line

    @staticmethod
    def _init(
        wandb: ModuleType,
        run: RunInfo,
        config: Mapping[str, object],
        run_id: str,
        mode: str,
        directory: Path,
    ) -> Any:
        settings = wandb.Settings(
            console="off",
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            silent=True,
            init_timeout=INIT_TIMEOUT_S,
            x_transaction_log_flush_interval=FLUSH_INTERVAL_S,
        )
        return wandb.init(
            project=run.project,
            name=run.run_name,
            group=run.group,
            tags=list(run.tags),
            config=dict(config),
            dir=str(directory),
            id=run_id,
            resume="allow",
            mode=mode,
            settings=settings,
        )
