"""The local backend's `RestClient`: list and delete the checkpoints under the service root.

A checkpoint's id is its directory relative to the root (``<run_id>/weights/<name>``);
the listing reads the directories on disk, so it covers earlier processes' checkpoints
too. Like pytrio's, the synchronous methods return `concurrent.futures.Future`s.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from pytrio.errors.base import ValidationError
from pytrio.types.rest import Checkpoint, CheckpointsListResponse, Cursor

from grpo.backends import _local_checkpoint as checkpoints

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
