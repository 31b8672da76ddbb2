"""The run registry of `grpo serve`: sessions, training and sampling runs, checkpoints.

Every operation takes the decoded request and returns the JSON-ready response dict that
pytrio 0.2.9's strict response models accept, or raises `ServeError` (an HTTP status and a
PyTRIO error code). The registry also hands out the actor credentials a run's creation
returns and the download token of checkpoint archives. Trainer events are
`grpo.serve.events`' business; the runs they train are the ones registered here.

- A training run records its LoRA config as requested; ``trainer.init_run`` creates its
  `LocalTrainingClient` (``client``), and closing its session frees it.
- ``save_weights_and_get_sampling_client`` (a TEMPORARY save) keeps the weights in memory
  (``memory://`` URIs, the last 16 kept) as the in-process backend does; named saves are
  checkpoint directories (``local://``), listed, downloadable (a tar) and deletable
  through the RestClient endpoints for the server's lifetime.
"""

from __future__ import annotations

import collections
import io
import secrets
import shutil
import tarfile
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pytrio.errors.base import PyTrioError

from grpo.backends.local import (
    LocalSamplingClient,
    checkpoint_lora_spec,
    lora_wire_fields,
    read_checkpoint_metadata,
    resolve_checkpoint,
)
from grpo.serve.access import DownloadTokens
from grpo.serve.models import ModelCatalogue, path_problem
from grpo.serve.wire import (
    CheckpointRecord,
    SamplingRun,
    ServeError,
    TrainingRun,
    checkpoint_record,
    local_call,
    not_found,
    now_iso,
    training_run_record,
)

MEMORY_SCHEME = "memory://"
_MEMORY_SAMPLERS_KEPT = 16
_SAMPLING_RUNS_KEPT = 32  # the most recently used; each may hold a copy of LoRA weights
_JWT_LIFETIME = timedelta(days=7)
METADATA_FILE = "grpo_local.json"  # the local backend's record (its package does not export it)


def _damaged(path: Path, problem: str) -> ServeError:
    """The 409 of a damaged store entry, naming its file."""
    return ServeError(
        409,
        "checkpoint.damaged",
        f"{path} is damaged ({problem:.300}); restore it from a backup, or delete the checkpoint",
    )


class RunRegistry:
    """The server's sessions, runs and checkpoints on one local backend (thread-safe)."""

    def __init__(self, catalogue: ModelCatalogue, actor_endpoint: str, files_url: str) -> None:
        self.catalogue = catalogue
        self.local = catalogue.local  # the runs' backend and store: the catalogue's
        self.root = catalogue.root
        self.actor_endpoint = actor_endpoint
        self.files_url = files_url
        self.downloads = DownloadTokens()
        self._lock = threading.Lock()
        self._sessions: dict[str, dict[str, Any]] = {}
        self._training: dict[str, TrainingRun] = {}
        self._sampling: collections.OrderedDict[str, SamplingRun] = collections.OrderedDict()
        self._checkpoints: dict[str, CheckpointRecord] = {}
        self._memory: collections.OrderedDict[str, LocalSamplingClient] = collections.OrderedDict()
        # The OpenAI-compatible API's samplers: (what `model` named, its version) -> sampler.
        self._samplers: collections.OrderedDict[tuple[str, int], LocalSamplingClient] = (
            collections.OrderedDict()
        )
        self.actor_tokens: set[str] = set()

    # --- sessions ---------------------------------------------------------------------

    def create_session(self) -> dict[str, Any]:
        """`ServiceSessionCreateResponse` for a new session."""
        cuid = f"session-{uuid.uuid4().hex[:12]}"
        created = now_iso()
        with self._lock:
            self._sessions[cuid] = {
                "status": "ACTIVE",
                "created_at": created,
                "updated_at": created,
            }
        return {
            "service_session_cuid": cuid,
            "workspace_cuid": "local-workspace",
            "status": "ACTIVE",
            "created_at": created,
        }

    def _session(self, cuid: str) -> dict[str, Any]:
        with self._lock:
            if cuid not in self._sessions:
                raise not_found("service session", cuid)
            return self._sessions[cuid]

    def get_session(self, cuid: str) -> dict[str, Any]:
        """`ServiceSessionGetResponse`: the session's training and sampling runs."""
        session = self._session(cuid)
        with self._lock:
            training = [run.cuid for run in self._training.values() if run.session == cuid]
            sampling = [run.cuid for run in self._sampling.values() if run.session == cuid]
        return {
            "service_session_cuid": cuid,
            "workspace_cuid": "local-workspace",
            **session,
            "training_run_cuids": training,
            "sampling_run_cuids": sampling,
        }

    def list_sessions(self, limit: int, offset: int) -> dict[str, Any]:
        """`ServiceSessionListResponse`, oldest first."""
        with self._lock:
            items = [
                {"service_session_cuid": cuid, "workspace_cuid": "local-workspace", **session}
                for cuid, session in self._sessions.items()
            ]
        return {
            "service_sessions": items[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total": len(items)},
        }

    def renew_session(self, cuid: str) -> dict[str, Any]:
        """`ServiceSessionRenewResponse` (sessions never expire here)."""
        session = self._session(cuid)
        return {
            "service_session_cuid": cuid,
            "workspace_cuid": "local-workspace",
            "status": session["status"],
            "updated_at": now_iso(),
        }

    def close_session(self, cuid: str, status: str) -> None:
        """Mark a session ENDED/CANCELLED and free its models' adapters; records stay readable."""
        session = self._session(cuid)
        with self._lock:
            session.update(status=status, updated_at=now_iso())
            for run in self._training.values():
                if run.session == cuid:
                    run.client = None
            for key in [key for key, run in self._sampling.items() if run.session == cuid]:
                del self._sampling[key]

    # --- runs -------------------------------------------------------------------------

    def _actor(self) -> dict[str, Any]:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self.actor_tokens.add(token)
        return {
            "actor": {
                "actor_cuid": "local-actor",
                "endpoint": self.actor_endpoint,
                "connect_mode": "direct",
                "tls_enabled": False,
            },
            "actor_jwt": {
                "token": token,
                "expires_at": (datetime.now(UTC) + _JWT_LIFETIME).isoformat(),
            },
        }

    def _run_created(
        self, run: TrainingRun | SamplingRun, cuid_key: str, index: int, **limits: Any
    ) -> dict[str, Any]:
        """The create response of a training or sampling run: its cuid under `cuid_key`, its
        session, model, `limits` (``trainer`` or ``sampler``), a fresh actor and its time."""
        return {
            cuid_key: run.cuid,
            "service_session_cuid": run.session,
            "workspace_cuid": "local-workspace",
            "status": "ACTIVE",
            "run_index": index,
            "model_spec_cuid": f"model-{run.base_model}",
            "model_alias": run.base_model,
            "model_id": run.model_id,
            **limits,
            **self._actor(),
            "created_at": run.created_at,
        }

    def create_training_run(self, session: str, request: dict[str, Any]) -> dict[str, Any]:
        """`TrainingRunCreateResponse`; the model loads at the run's `trainer.init_run`."""
        self._session(session)
        source = str(request.get("source_checkpoint_uri") or "")
        base_model = str(request.get("base_model") or "")
        if source:
            base_model = str(self._checkpoint_metadata(source)["base_model"])
        if not base_model:
            raise ServeError(
                400,
                "validation.missing_base_model",
                "base_model is empty and no source_checkpoint_uri names one",
            )
        name, model_id = self.catalogue.resolve(base_model)
        created = now_iso()
        run = TrainingRun(
            cuid=f"train-{uuid.uuid4().hex[:12]}",
            session=session,
            base_model=name,
            model_id=model_id,
            lora=lora_wire_fields(request),
            source_checkpoint_uri=source,
            restore_optimizer=bool(request.get("restore_optimizer", False)),
            created_at=created,
            updated_at=created,
        )
        with self._lock:
            self._training[run.cuid] = run
        return self._run_created(
            run, "training_run_cuid", len(self._training), trainer=self.catalogue.limits(name)
        )

    def training_run(self, cuid: str) -> TrainingRun:
        """A registered training run (404 if unknown)."""
        with self._lock:
            if cuid not in self._training:
                raise not_found("training run", cuid)
            return self._training[cuid]

    def update_training_run(self, cuid: str, request: dict[str, Any]) -> dict[str, Any]:
        """`TrainingRunUpdateResponse`: bind a checkpoint to load at init (load_state)."""
        run = self.training_run(cuid)
        if run.client is not None:
            raise ServeError(
                409,
                "validation.already_initialized",
                "load_state cannot be called after training has started",
            )
        source = str(request["source_checkpoint_uri"])
        self._checkpoint_metadata(source)
        run.source_checkpoint_uri, run.restore_optimizer = (
            source,
            bool(request["restore_optimizer"]),
        )
        return {
            "source_checkpoint_uri": source,
            "restore_optimizer": run.restore_optimizer,
            "trainer": self.catalogue.limits(run.base_model),
            **self._actor(),
        }

    def renew_run(self, cuid: str, kind: str) -> dict[str, Any]:
        """`TrainingRunRenewResponse` / `SamplingRunRenewResponse`: fresh actor credentials."""
        run = self.training_run(cuid) if kind == "training" else self.sampling_run(cuid)
        return {
            f"{kind}_run_cuid": cuid,
            "service_session_cuid": run.session,
            "workspace_cuid": "local-workspace",
            **self._actor(),
        }

    def get_training_run(self, cuid: str) -> dict[str, Any]:
        """`TrainingRunGetResponse`."""
        return training_run_record(self.training_run(cuid))

    def list_training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        """`TrainingRunListResponse`, oldest first."""
        with self._lock:
            runs = list(self._training.values())
        return {
            "training_runs": [training_run_record(run) for run in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total": len(runs)},
        }

    def find_by_checkpoint(self, uri: str) -> dict[str, Any]:
        """`TrainingRunFindByCheckpointURIResponse`: the LoRA config a checkpoint was saved with.

        ``base_model`` is the run's ``model_id`` (pytrio 0.2.8/0.2.9's ``load_state`` checks it
        against the run's), which the catalogue lists too (pytrio 0.2.3 looks it up there).
        """
        metadata = self._checkpoint_metadata(uri)
        _name, model_id = self.catalogue.resolve(str(metadata["base_model"]))
        return {"base_model": model_id, **self._lora_spec(uri, metadata).to_wire()}

    def _checkpoint_metadata(self, uri: str) -> dict[str, object]:
        """A checkpoint's `grpo_local.json`: 404 if there is none, 409 naming it if damaged."""
        if uri.startswith(MEMORY_SCHEME):
            raise ServeError(
                400,
                "validation.checkpoint_not_found",
                f"{uri!r} holds sampler weights only; save_state gives a loadable checkpoint",
            )
        try:
            directory = resolve_checkpoint(uri)
        except PyTrioError as error:
            raise ServeError(404, error.code, error.message) from None
        except (OSError, ValueError) as error:  # a name too long for the file system, a NUL
            raise ServeError(
                400,
                "validation.checkpoint_not_found",
                f"no local checkpoint at {uri!r:.200}: {error}",
            ) from None
        try:
            metadata = read_checkpoint_metadata(directory)
            if isinstance(metadata, dict) and isinstance(metadata.get("base_model"), str):
                return metadata
            problem = "it holds no base_model"
        except PyTrioError as error:
            raise ServeError(409, error.code, error.message) from None
        except (OSError, ValueError, AttributeError) as error:
            problem = f"{type(error).__name__}: {error}"
        raise _damaged(directory / METADATA_FILE, problem)

    def _lora_spec(self, uri: str, metadata: dict[str, object]) -> Any:
        """The LoRA spec of a checkpoint's metadata (409 naming the file if it has none)."""
        try:
            return checkpoint_lora_spec(metadata)
        except (PyTrioError, KeyError, ValueError, TypeError) as error:
            message = error.message if isinstance(error, PyTrioError) else repr(error)
            raise _damaged(resolve_checkpoint(uri) / METADATA_FILE, message) from None

    def create_sampling_run(self, session: str, request: dict[str, Any]) -> dict[str, Any]:
        """`SamplingRunCreateResponse` for the base model or saved/in-memory LoRA weights."""
        self._session(session)
        name, model_id = self.catalogue.resolve(str(request["base_model"]))
        source = str(request.get("source_checkpoint_uri") or "")
        if source.startswith(MEMORY_SCHEME):
            with self._lock:
                if source not in self._memory:
                    raise not_found("in-memory sampler weights", source)
                client = self._memory[source]
        else:
            if source:
                self._checkpoint_metadata(source)  # a damaged store entry: a 409 naming it
            client = local_call(lambda: self.local.create_sampling_client(name, source or None))
        run = SamplingRun(
            cuid=f"sampler-{uuid.uuid4().hex[:12]}",
            session=session,
            base_model=name,
            model_id=model_id,
            source_checkpoint_uri=source,
            created_at=now_iso(),
            client=client,
        )
        with self._lock:
            self._sampling[run.cuid] = run
            while len(self._sampling) > _SAMPLING_RUNS_KEPT:
                self._sampling.popitem(last=False)
            index = len(self._sampling)
        return self._run_created(
            run, "sampling_run_cuid", index, sampler=self.catalogue.limits(name, trainer=False)
        )

    def sampler(self, model: str) -> LocalSamplingClient:
        """A sampler of `model` for the OpenAI-compatible API: in-memory sampler weights
        (``memory://...``), saved ones (``local://...`` or their directory), or a served
        model's name, alias or local directory (404 naming the choices otherwise).

        Samplers are kept (the `_SAMPLING_RUNS_KEPT` most recently used); saved weights are
        reloaded when their checkpoint was saved again since.
        """
        if model.startswith(MEMORY_SCHEME):
            with self._lock:
                if model not in self._memory:
                    raise not_found("in-memory sampler weights", model)
                return self._memory[model]
        try:
            directory: Path | None = resolve_checkpoint(model)
        except (PyTrioError, OSError, ValueError):  # no checkpoint: a model's name or directory
            directory = None
        if directory is None:
            try:
                name, _model_id = self.catalogue.resolve(model)
            except ServeError as error:
                raise ServeError(
                    404,
                    "model_not_found",
                    f"model {model!r:.200} is neither a served model nor sampler weights"
                    f"{path_problem(model)}; "
                    f"use one of {self.catalogue.names()}, a path that save_weights_for_sampler "
                    "returned (local://...), or a local Hugging Face model directory",
                ) from error
            key, weights = (name, 0), None
        else:
            metadata = self._checkpoint_metadata(model)
            name, _model_id = self.catalogue.resolve(str(metadata["base_model"]))
            version = (directory / METADATA_FILE).stat().st_mtime_ns
            key, weights = (str(directory.resolve()), version), model
        with self._lock:
            if key in self._samplers:
                self._samplers.move_to_end(key)
                return self._samplers[key]
        client = local_call(lambda: self.local.create_sampling_client(name, weights))
        with self._lock:
            self._samplers[key] = client
            while len(self._samplers) > _SAMPLING_RUNS_KEPT:
                self._samplers.popitem(last=False)
        return client

    def sampling_run(self, cuid: str) -> SamplingRun:
        """A kept sampling run, now the most recently used (404 if unknown or dropped)."""
        with self._lock:
            if cuid not in self._sampling:
                raise ServeError(
                    404,
                    "not_found",
                    f"sampling run {cuid!r} does not exist here, or was dropped (the server "
                    f"keeps the {_SAMPLING_RUNS_KEPT} most recently used and frees a closed "
                    "session's); create a new sampling client",
                )
            self._sampling.move_to_end(cuid)
            return self._sampling[cuid]

    def get_sampling_run(self, cuid: str) -> dict[str, Any]:
        """`SamplingRunGetResponse`."""
        run = self.sampling_run(cuid)
        return {
            "sampling_run_cuid": cuid,
            "service_session_cuid": run.session,
            "workspace_cuid": "local-workspace",
            "status": "ACTIVE",
            "base_model": run.base_model,
            "model_id": run.model_id,
            "alias": run.base_model,
            "source_checkpoint_uri": run.source_checkpoint_uri or None,
            "created_at": run.created_at,
            "updated_at": run.created_at,
        }

    # --- checkpoints (RestClient) -----------------------------------------------------

    def list_checkpoints(self, run: str | None, limit: int, offset: int) -> dict[str, Any]:
        """`CheckpointListResponse` for one training run, or all of them, oldest first."""
        if run is not None:
            self.training_run(run)
        with self._lock:
            chosen = [ckpt for ckpt in self._checkpoints.values() if run is None or ckpt.run == run]
            records = [
                checkpoint_record(ckpt, self._training.get(ckpt.run))
                for ckpt in chosen[offset : offset + limit]
            ]
        return {
            "checkpoints": records,
            "cursor": {"offset": offset, "limit": limit, "total": len(chosen)},
        }

    def _checkpoint(self, cuid: str) -> CheckpointRecord:
        with self._lock:
            if cuid not in self._checkpoints:
                raise not_found("checkpoint", cuid)
            return self._checkpoints[cuid]

    def download_url(self, cuid: str) -> dict[str, Any]:
        """`CheckpointDownloadResponse`: a tar of the checkpoint directory, served here, at a
        URL whose token opens this checkpoint only, until `expires_at`."""
        self._checkpoint(cuid)
        token, expires = self.downloads.issue(cuid)
        return {
            "url": f"{self.files_url}/checkpoints/{cuid}.tar?token={token}",
            "expires_at": expires.isoformat(),
            "source": "object_storage",
            "checkpoint_status": "READY",
            "tls_cert_pem": None,
            "tls_not_after": None,
        }

    def archive(self, cuid: str) -> bytes:
        """The checkpoint directory as an uncompressed tar, its files at the top level."""
        directory = self._directory(self._checkpoint(cuid))
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for path in sorted(directory.iterdir()):
                archive.add(path, arcname=path.name)
        return buffer.getvalue()

    def delete_checkpoint(self, cuid: str) -> None:
        """Delete a checkpoint's directory and record."""
        checkpoint = self._checkpoint(cuid)
        shutil.rmtree(self._directory(checkpoint), ignore_errors=True)
        with self._lock:
            self._checkpoints.pop(cuid, None)

    def _directory(self, checkpoint: CheckpointRecord) -> Path:
        """A listed checkpoint's directory (409 if it was removed behind the server's back)."""
        try:
            return resolve_checkpoint(checkpoint.uri)
        except PyTrioError:
            raise ServeError(
                409,
                "checkpoint.missing",
                f"checkpoint {checkpoint.cuid} ({checkpoint.uri}) is listed but its directory or "
                f"its {METADATA_FILE} is gone from disk",
            ) from None

    def add_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """Record a named save; an overwritten save replaces the record of its URI."""
        with self._lock:
            for key, existing in list(self._checkpoints.items()):
                if existing.uri == checkpoint.uri:
                    del self._checkpoints[key]
            self._checkpoints[checkpoint.cuid] = checkpoint

    def forget_checkpoint(self, uri: str) -> None:
        """Drop the record of a checkpoint deleted through another route (if any)."""
        with self._lock:
            for key, existing in list(self._checkpoints.items()):
                if existing.uri == uri:
                    del self._checkpoints[key]

    def keep_sampler(self, uri: str, sampler: LocalSamplingClient) -> None:
        """Keep in-memory sampler weights under their ``memory://`` URI (the last 16)."""
        with self._lock:
            self._memory[uri] = sampler
            while len(self._memory) > _MEMORY_SAMPLERS_KEPT:
                self._memory.popitem(last=False)
