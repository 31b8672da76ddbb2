"""The local backend's `RestClient`: training runs and checkpoints under the service root.

A checkpoint's id is its directory relative to the root (``<run_id>/weights/<name>``);
the listing reads the directories on disk, so it covers earlier processes' checkpoints
too. A training run is a directory of the root holding checkpoints. ``download_checkpoint``
writes an uncompressed tar of the checkpoint directory (``adapter_config.json``,
``adapter_model.safetensors``, ...). Like pytrio's, the synchronous methods return
`concurrent.futures.Future`s.
"""

from __future__ import annotations

import shutil
import tarfile
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from pytrio.errors.base import ValidationError
from pytrio.types.rest import (
    Checkpoint,
    CheckpointDownloadResult,
    CheckpointsListResponse,
    Cursor,
    TrainingRun,
    TrainingRunsResponse,
)

from grpo.backends.local import checkpoint as checkpoints

T = TypeVar("T")


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


class LocalRestClient:
    """Checkpoint metadata of a local service root, with pytrio's `RestClient` methods."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def _all(self) -> list[Checkpoint]:
        found = []
        for metadata_file in sorted(self._root.glob(f"*/*/*/{checkpoints.METADATA_FILE}")):
            directory = metadata_file.parent
            metadata = checkpoints.read_metadata(directory)
            created = datetime.fromtimestamp(float(metadata["created_unix"]), UTC)  # type: ignore[arg-type]
            ttl = metadata.get("ttl_seconds")
            found.append(
                Checkpoint(
                    checkpoint_id=str(directory.relative_to(self._root)),
                    checkpoint_type="training" if metadata["kind"] == "state" else "sampler",
                    time=created,
                    path=checkpoints.to_uri(directory),
                    size_bytes=sum(path.stat().st_size for path in directory.iterdir()),
                    expires_at=created + timedelta(seconds=int(ttl)) if ttl else None,  # type: ignore[arg-type]
                )
            )
        return sorted(found, key=lambda checkpoint: checkpoint.time)

    def list_checkpoints(self, training_run_id: str) -> Future[CheckpointsListResponse]:
        """Every checkpoint of one training run, oldest first."""
        prefix = f"{training_run_id}/"
        chosen = [c for c in self._all() if c.checkpoint_id.startswith(prefix)]
        return _done(CheckpointsListResponse(checkpoints=chosen))

    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        """Async twin of `list_checkpoints`."""
        return self.list_checkpoints(training_run_id).result()

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> Future[CheckpointsListResponse]:
        """A page of all checkpoints under the root, oldest first."""
        everything = self._all()
        cursor = Cursor(offset=offset, limit=limit, total_count=len(everything))
        page = everything[offset : offset + limit]
        return _done(CheckpointsListResponse(checkpoints=page, cursor=cursor))

    async def list_user_checkpoints_async(
        self, limit: int = 100, offset: int = 0
    ) -> CheckpointsListResponse:
        """Async twin of `list_user_checkpoints`."""
        return self.list_user_checkpoints(limit, offset).result()

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> Future[None]:
        """Delete checkpoint `checkpoint_id` (an id from the listings) of run `training_run_id`."""
        directory = (self._root / checkpoint_id).resolve()
        run_directory = (self._root / training_run_id).resolve()
        if (
            run_directory not in directory.parents
            or not (directory / checkpoints.METADATA_FILE).is_file()
        ):
            raise ValidationError(
                f"checkpoint_id {checkpoint_id!r} is no checkpoint of training run "
                f"{training_run_id!r}; take ids from list_checkpoints",
                code="validation.checkpoint_not_found",
            )
        shutil.rmtree(directory)
        return _done(None)

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        """Async twin of `delete_checkpoint`."""
        return self.delete_checkpoint(training_run_id, checkpoint_id).result()

    def _runs(self) -> list[TrainingRun]:
        by_run: dict[str, list[Checkpoint]] = {}
        for checkpoint in self._all():
            by_run.setdefault(checkpoint.checkpoint_id.split("/")[0], []).append(checkpoint)
        runs = []
        for run_id, found in by_run.items():
            metadata = checkpoints.read_metadata(self._root / found[-1].checkpoint_id)
            states = [c for c in found if c.checkpoint_type == "training"]
            samplers = [c for c in found if c.checkpoint_type == "sampler"]
            runs.append(
                TrainingRun(
                    training_run_id=run_id,
                    base_model=str(metadata["base_model"]),
                    model_owner="local",
                    is_lora=True,
                    lora_rank=int(metadata["lora_rank"]),  # type: ignore[arg-type]
                    last_request_time=found[-1].time,
                    last_checkpoint=states[-1] if states else None,
                    last_sampler_checkpoint=samplers[-1] if samplers else None,
                )
            )
        return sorted(runs, key=lambda run: run.last_request_time)

    def list_training_runs(
        self, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> Future[TrainingRunsResponse]:
        """A page of the training runs under the root, least recently saved first."""
        runs = self._runs()
        cursor = Cursor(offset=offset, limit=limit, total_count=len(runs))
        page = runs[offset : offset + limit]
        return _done(TrainingRunsResponse(training_runs=page, cursor=cursor))

    def get_training_run(
        self, training_run_id: str, access_scope: str = "owned"
    ) -> Future[TrainingRun]:
        """One training run's metadata (ValidationError if the root holds none of that id)."""
        for run in self._runs():
            if run.training_run_id == training_run_id:
                return _done(run)
        raise ValidationError(
            f"no training run {training_run_id!r} under {self._root}; take ids from "
            "list_training_runs",
            code="validation.training_run_not_found",
        )

    def download_checkpoint(
        self, checkpoint_id: str, destination_path: str | Path, *, resume: bool = True
    ) -> Future[CheckpointDownloadResult]:
        """Write checkpoint `checkpoint_id` as a tar file at `destination_path` (replaced whole)."""
        directory = (self._root / checkpoint_id).resolve()
        if (
            self._root.resolve() not in directory.parents
            or not (directory / checkpoints.METADATA_FILE).is_file()
        ):
            raise ValidationError(
                f"checkpoint_id {checkpoint_id!r} is no checkpoint under {self._root}; take ids "
                "from list_checkpoints",
                code="validation.checkpoint_not_found",
            )
        destination = Path(destination_path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(destination.name + ".part")
        with tarfile.open(partial, "w") as archive:
            for file in sorted(directory.iterdir()):
                archive.add(file, arcname=file.name)
        partial.replace(destination)
        size = destination.stat().st_size
        return _done(
            CheckpointDownloadResult(
                checkpoint_id=checkpoint_id,
                path=str(destination),
                bytes_written=size,
                file_size_bytes=size,
                status_code=200,
                resumed=False,
            )
        )
