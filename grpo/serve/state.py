"""What `grpo serve` serves: PyTRIO's Control and Actor operations on the embedded local backend.

Every operation takes the decoded request and returns the JSON/msgpack-ready response dict
that pytrio 0.2.9's strict response models accept, or raises `ServeError` (an HTTP status
and a PyTRIO error code). Training and sampling run on one `LocalServiceClient`, so a run
through the server computes what the same calls compute in process.

How PyTRIO's notions map onto the local backend:

- A training run's ``model_id`` is the directory holding its tokenizer (for the built-in
  model, a copy written under ``<root>/tokenizers/``): pytrio's ``get_tokenizer`` loads
  ``AutoTokenizer.from_pretrained(model_id, local_files_only=True)``, so this finds it
  offline. The catalogue and ``get_supported_models`` keep the model's name.
- ``trainer.init_run`` creates the `LocalTrainingClient` (and loads the checkpoint the run
  was created from); later events call its methods in arrival order, which is PyTRIO's
  submission order. Events are answered ``accepted`` at once and resolved by long polls.
- A failed operation (bad loss config, unknown checkpoint ...) is a ``failed`` event or a
  4xx with the local backend's ``validation.*`` code, never a 5xx: the SDK retries 5xx and
  429 for up to 15 minutes, and a 4xx on an event submit would break its training run.
- ``save_weights_and_get_sampling_client`` (a TEMPORARY save) keeps the weights in memory
  (``memory://`` URIs, the last 16 kept) as the in-process backend does; named saves are
  checkpoint directories (``local://``), listed, downloadable (a tar) and deletable
  through the RestClient endpoints for the server's lifetime.
"""

from __future__ import annotations

import collections
import io
import shutil
import tarfile
import threading
import uuid
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pytrio.errors.base import PyTrioError
from pytrio.protocol.actor.events.event import EventEnvelope, EventType
from pytrio.protocol.actor.events.trainer.forward import TrainerForwardBackwardPayload
from pytrio.protocol.actor.events.trainer.init_run import TrainerInitRunPayload
from pytrio.protocol.actor.events.trainer.optimize_step import TrainerOptimizeStepPayload
from pytrio.protocol.actor.events.trainer.save import TrainerSavePayload
from pytrio.protocol.actor.model_input import WireEncodedTextChunk
from pytrio.protocol.actor.sampling_run.sample import SampleRequest
from pytrio.types import AdamParams, ModelInput

from grpo.backends.local import (
    LocalSamplingClient,
    LocalServiceClient,
    LocalTrainingClient,
    checkpoint_lora_spec,
    read_checkpoint_metadata,
    resolve_checkpoint,
)
from grpo.serve.wire import (
    CheckpointRecord,
    Event,
    SamplingRun,
    ServeError,
    TrainingRun,
    chain,
    checkpoint_record,
    datum_from_wire,
    forward_result,
    local_call,
    model_list,
    not_found,
    now_iso,
    sampling_params,
    training_run_record,
)

MEMORY_SCHEME = "memory://"
_MEMORY_SAMPLERS_KEPT = 16
_SAMPLING_RUNS_KEPT = 32  # the most recently used; each may hold a copy of LoRA weights
_EVENTS_KEPT = 4096
_JWT_LIFETIME = timedelta(days=7)


class ServeState:
    """The server's runs, events and checkpoints on one local backend (all methods thread-safe)."""

    def __init__(
        self,
        local: LocalServiceClient,
        root: Path,
        actor_endpoint: str,
        files_url: str,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.local = local
        self.root = root
        self.actor_endpoint = actor_endpoint
        self.files_url = files_url
        self.download_token = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._sessions: dict[str, dict[str, Any]] = {}
        self._training: dict[str, TrainingRun] = {}
        self._sampling: collections.OrderedDict[str, SamplingRun] = collections.OrderedDict()
        self._events: collections.OrderedDict[str, Event] = collections.OrderedDict()
        self._checkpoints: dict[str, CheckpointRecord] = {}
        self._memory: collections.OrderedDict[str, LocalSamplingClient] = collections.OrderedDict()
        self._model_ids: dict[str, str] = {}  # model name -> model_id (tokenizer directory)
        self.actor_tokens: set[str] = set()
        self.event_log: list[tuple[str, str]] = []  # (training run, event type) in arrival order
        self._capabilities = local.get_server_capabilities()
        names = [model.model_name for model in self._capabilities.supported_models]
        self.aliases = dict(aliases or {})  # a name a program asks for -> a served model's name
        for alias, name in self.aliases.items():
            if name not in names:
                raise ValueError(f"--model-alias {alias}={name}: {name!r} is not one of {names}")

    # --- identity, models -------------------------------------------------------------

    def models(self, limit: int, offset: int) -> dict[str, Any]:
        """`ModelListResponse`: the served models (and aliases) with their real limits."""
        return model_list(self._capabilities.supported_models, self.aliases, limit, offset)

    def _limits(self, base_model: str) -> dict[str, Any]:
        for model in self._capabilities.supported_models:
            if model.model_name == base_model:
                return {
                    "max_batch_size": None,
                    "max_tokens_per_request": None,
                    "max_seq_len": model.training.max_seq_len,
                }
        return {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": None}

    def _resolve_model(self, base_model: str) -> tuple[str, str]:
        """(the local backend's model name, the model_id handed to pytrio) for `base_model`."""
        names = [model.model_name for model in self._capabilities.supported_models]
        with self._lock:
            by_id = {model_id: name for name, model_id in self._model_ids.items()}
        if base_model in by_id:
            return by_id[base_model], base_model
        base_model = self.aliases.get(base_model, base_model)
        if base_model in names:
            return base_model, self._tokenizer_directory(base_model)
        directory = Path(base_model).expanduser()
        if directory.is_dir() and (directory / "config.json").is_file():
            resolved = str(directory.resolve())
            return resolved, resolved
        raise ServeError(
            404,
            "model_not_found",
            f"base_model {base_model!r} is not served here; use one of "
            f"{names + list(self.aliases)} or the path of a local Hugging Face model directory "
            "(or map the name: grpo serve --model-alias NAME=SERVED_MODEL)",
        )

    def _tokenizer_directory(self, name: str) -> str:
        """A directory with `name`'s tokenizer files (written once), for pytrio's get_tokenizer."""
        with self._lock:
            if name in self._model_ids:
                return self._model_ids[name]
        directory = self.root / "tokenizers" / name.replace("/", "--")
        tokenizer = self.local.create_sampling_client(name).get_tokenizer()
        tokenizer.save_pretrained(str(directory))
        with self._lock:
            self._model_ids[name] = str(directory.resolve())
            return self._model_ids[name]

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
        token = uuid.uuid4().hex
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
        name, model_id = self._resolve_model(base_model)
        created = now_iso()
        run = TrainingRun(
            cuid=f"train-{uuid.uuid4().hex[:12]}",
            session=session,
            base_model=name,
            model_id=model_id,
            rank=int(request["lora_rank"]),
            seed=request.get("seed"),
            train_mlp=bool(request["train_mlp"]),
            train_attn=bool(request["train_attn"]),
            train_unembed=bool(request["train_unembed"]),
            source_checkpoint_uri=source,
            restore_optimizer=bool(request.get("restore_optimizer", False)),
            created_at=created,
            updated_at=created,
        )
        with self._lock:
            self._training[run.cuid] = run
        return {
            "training_run_cuid": run.cuid,
            "service_session_cuid": session,
            "workspace_cuid": "local-workspace",
            "status": "ACTIVE",
            "run_index": len(self._training),
            "model_spec_cuid": f"model-{name}",
            "model_alias": name,
            "model_id": model_id,
            "trainer": self._limits(name),
            **self._actor(),
            "created_at": created,
        }

    def _training_run(self, cuid: str) -> TrainingRun:
        with self._lock:
            if cuid not in self._training:
                raise not_found("training run", cuid)
            return self._training[cuid]

    def update_training_run(self, cuid: str, request: dict[str, Any]) -> dict[str, Any]:
        """`TrainingRunUpdateResponse`: bind a checkpoint to load at init (load_state)."""
        run = self._training_run(cuid)
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
            "trainer": self._limits(run.base_model),
            **self._actor(),
        }

    def renew_run(self, cuid: str, kind: str) -> dict[str, Any]:
        """`TrainingRunRenewResponse` / `SamplingRunRenewResponse`: fresh actor credentials."""
        run = self._training_run(cuid) if kind == "training" else self._sampling_run(cuid)
        return {
            f"{kind}_run_cuid": cuid,
            "service_session_cuid": run.session,
            "workspace_cuid": "local-workspace",
            **self._actor(),
        }

    def get_training_run(self, cuid: str) -> dict[str, Any]:
        """`TrainingRunGetResponse`."""
        return training_run_record(self._training_run(cuid))

    def list_training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        """`TrainingRunListResponse`, oldest first."""
        with self._lock:
            runs = list(self._training.values())
        return {
            "training_runs": [training_run_record(run) for run in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total": len(runs)},
        }

    def find_by_checkpoint(self, uri: str) -> dict[str, Any]:
        """`TrainingRunFindByCheckpointURIResponse`: the LoRA config a checkpoint was saved with."""
        metadata = self._checkpoint_metadata(uri)
        _name, model_id = self._resolve_model(str(metadata["base_model"]))
        spec = checkpoint_lora_spec(metadata)
        return {
            "base_model": model_id,
            "lora_rank": spec.rank,
            "seed": spec.seed,
            "train_mlp": spec.train_mlp,
            "train_attn": spec.train_attn,
            "train_unembed": spec.train_unembed,
        }

    def _checkpoint_metadata(self, uri: str) -> dict[str, object]:
        if uri.startswith(MEMORY_SCHEME):
            raise ServeError(
                400,
                "validation.checkpoint_not_found",
                f"{uri!r} holds sampler weights only; save_state gives a loadable checkpoint",
            )
        try:
            return read_checkpoint_metadata(resolve_checkpoint(uri))
        except PyTrioError as error:
            raise ServeError(404, error.code, error.message) from None

    def create_sampling_run(self, session: str, request: dict[str, Any]) -> dict[str, Any]:
        """`SamplingRunCreateResponse` for the base model or saved/in-memory LoRA weights."""
        self._session(session)
        name, model_id = self._resolve_model(str(request["base_model"]))
        source = str(request.get("source_checkpoint_uri") or "")
        if source.startswith(MEMORY_SCHEME):
            with self._lock:
                if source not in self._memory:
                    raise not_found("in-memory sampler weights", source)
                client = self._memory[source]
        else:
            client = local_call(lambda: self.local.create_sampling_client(name, source or None))
        created = now_iso()
        run = SamplingRun(
            cuid=f"sampler-{uuid.uuid4().hex[:12]}",
            session=session,
            base_model=name,
            model_id=model_id,
            source_checkpoint_uri=source,
            created_at=created,
            client=client,
        )
        with self._lock:
            self._sampling[run.cuid] = run
            while len(self._sampling) > _SAMPLING_RUNS_KEPT:
                self._sampling.popitem(last=False)
        return {
            "sampling_run_cuid": run.cuid,
            "service_session_cuid": session,
            "workspace_cuid": "local-workspace",
            "status": "ACTIVE",
            "run_index": len(self._sampling),
            "model_spec_cuid": f"model-{name}",
            "model_alias": name,
            "model_id": model_id,
            "sampler": self._limits(name),
            **self._actor(),
            "created_at": created,
        }

    def _sampling_run(self, cuid: str) -> SamplingRun:
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
        run = self._sampling_run(cuid)
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

    # --- events -----------------------------------------------------------------------

    def submit_event(self, envelope: EventEnvelope) -> Event:
        """Start one trainer event (in arrival order); a duplicate event id is a 409."""
        run = self._training_run(envelope.metadata.run_id)
        with self._lock:
            if envelope.event_id in self._events:
                raise ServeError(
                    409, "event_exists", f"event {envelope.event_id} was already submitted"
                )
        event = Event(event_id=envelope.event_id, type=envelope.type, future=Future())
        try:
            self._start(run, envelope, event)
        except Exception as error:  # noqa: BLE001 - a refused event is a failed event
            if not event.future.done():
                event.future.set_exception(error)
        with self._lock:
            self._events[event.event_id] = event
            while len(self._events) > _EVENTS_KEPT:
                self._events.popitem(last=False)
            self.event_log.append((run.cuid, envelope.type.value))
            run.updated_at = now_iso()
        return event

    def event(self, event_id: str) -> Event:
        """A submitted event."""
        with self._lock:
            if event_id not in self._events:
                raise not_found("event", event_id)
            return self._events[event_id]

    def _start(self, run: TrainingRun, envelope: EventEnvelope, event: Event) -> None:
        kind = envelope.type
        if kind == EventType.TRAINER_INIT_RUN:
            event.future.set_result(
                self._init_run(run, TrainerInitRunPayload.model_validate(envelope.payload))
            )
            return
        client = run.client
        if client is None:
            raise ServeError(
                409, "validation.not_initialized", "the run got an event before trainer.init_run"
            )
        if kind in (EventType.TRAINER_FORWARD, EventType.TRAINER_FORWARD_BACKWARD):
            payload = TrainerForwardBackwardPayload.model_validate(envelope.payload)
            datums = [datum_from_wire(item) for item in payload.data]
            event.input_tokens = sum(len(datum.model_input) for datum in datums)
            method = (
                client.forward if kind == EventType.TRAINER_FORWARD else client.forward_backward
            )
            config = dict(payload.loss.config) or None
            chain(
                method(datums, payload.loss.type, config, payload.auto_shift),
                event.future,
                forward_result,
            )
        elif kind == EventType.TRAINER_OPTIMIZE_STEP:
            adam = TrainerOptimizeStepPayload.model_validate(envelope.payload).adam_params
            chain(
                client.optim_step(AdamParams(**adam.model_dump())),
                event.future,
                lambda response: {"metrics": dict(response.metrics)},
            )
        elif kind == EventType.TRAINER_SAVE_STATE:
            save = TrainerSavePayload.model_validate(envelope.payload)
            future = client.save_state(save.name, save.ttl_seconds, save.overwrite)
            chain(
                future, event.future, lambda response: self._saved(run, save, "TRAINING", response)
            )
        elif kind == EventType.TRAINER_SAVE_WEIGHTS:
            save = TrainerSavePayload.model_validate(envelope.payload)
            if save.visibility == "TEMPORARY":
                event.future.set_result(self._save_in_memory(run, client, save.name))
            else:
                future = client.save_weights_for_sampler(save.name, save.ttl_seconds)
                chain(
                    future,
                    event.future,
                    lambda response: self._saved(run, save, "SAMPLER", response),
                )
        else:
            raise ServeError(
                400, "validation.unsupported_event", f"{kind.value} is not served here"
            )

    def _init_run(self, run: TrainingRun, payload: TrainerInitRunPayload) -> dict[str, Any]:
        if run.client is not None:
            raise ServeError(
                409, "validation.already_initialized", f"run {run.cuid} is already initialized"
            )
        lora = payload.lora_config
        client = self.local.create_lora_training_client(
            run.base_model,
            rank=lora.rank,
            seed=lora.seed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            train_unembed=lora.train_unembed,
        )
        if payload.checkpoint_uri:
            load = client.load_state_with_optimizer if payload.load_optimizer else client.load_state
            load(payload.checkpoint_uri).result()
        run.client = client
        return {}

    def _saved(
        self, run: TrainingRun, save: TrainerSavePayload, kind: str, response: Any
    ) -> dict[str, Any]:
        checkpoint = CheckpointRecord(
            cuid=f"ckpt-{uuid.uuid4().hex[:12]}",
            run=run.cuid,
            name=save.name,
            checkpoint_type=kind,
            uri=response.path,
            size_bytes=int(response.size),
            created_at=now_iso(),
            ttl_seconds=save.ttl_seconds,
        )
        with self._lock:
            for key, existing in list(self._checkpoints.items()):
                if existing.uri == checkpoint.uri:  # an overwritten save replaces its record
                    del self._checkpoints[key]
            self._checkpoints[checkpoint.cuid] = checkpoint
        return {
            "checkpoint": {
                "uri": response.path,
                "model_id": run.model_id,
                "size_bytes": checkpoint.size_bytes,
                "checkpoint_cuid": checkpoint.cuid,
            }
        }

    def _save_in_memory(
        self, run: TrainingRun, client: LocalTrainingClient, name: str
    ) -> dict[str, Any]:
        sampler = client.save_weights_and_get_sampling_client()
        uri = f"{MEMORY_SCHEME}{run.cuid}/{name}"
        with self._lock:
            self._memory[uri] = sampler
            while len(self._memory) > _MEMORY_SAMPLERS_KEPT:
                self._memory.popitem(last=False)
        return {"checkpoint": {"uri": uri, "model_id": run.model_id, "size_bytes": 0}}

    # --- sampling ---------------------------------------------------------------------

    def sample(self, cuid: str, request: SampleRequest) -> dict[str, Any]:
        """`ActorSampleResponse` of one request (compute_logprobs when no token logprobs asked)."""
        client = self._sampling_run(cuid).client
        if not all(isinstance(chunk, WireEncodedTextChunk) for chunk in request.prompt.chunks):
            raise ServeError(
                400, "validation.image_unsupported", "the local backend samples text prompts only"
            )
        tokens = [token for chunk in request.prompt.chunks for token in chunk.tokens]
        prompt = ModelInput.from_ints(tokens)
        if request.return_prompt_logprobs and not request.return_token_logprobs:
            prompt_logprobs = local_call(lambda: client.compute_logprobs(prompt)).result()
            return {
                "request_id": request.request_id,
                "sampling_run": cuid,
                "sequences": [],
                "prompt_logprobs": prompt_logprobs,
                "usage": {"input_tokens": len(tokens), "output_tokens": 0},
            }
        params = sampling_params(request.sampling_params)
        response = local_call(
            lambda: client.sample(
                prompt,
                request.num_samples,
                params,
                request.return_prompt_logprobs,
                request.topk_prompt_logprobs,
                request.return_text,
            )
        ).result()
        sequences = [
            {
                "tokens": list(seq.tokens),
                "text": seq.text,
                "logprobs": list(seq.logprobs),
                "stop_reason": seq.stop_reason,
            }
            for seq in response.sequences
        ]
        return {
            "request_id": request.request_id,
            "sampling_run": cuid,
            "sequences": sequences,
            "prompt_logprobs": list(response.prompt_logprobs)
            if request.return_prompt_logprobs
            else None,
            "topk_prompt_logprobs": (
                [
                    None if row is None else [list(pair) for pair in row]
                    for row in response.topk_prompt_logprobs
                ]
                if request.topk_prompt_logprobs
                else None
            ),
            "usage": {
                "input_tokens": len(tokens),
                "output_tokens": sum(len(s["tokens"]) for s in sequences),
            },
        }

    # --- checkpoints (RestClient) -----------------------------------------------------

    def list_checkpoints(self, run: str | None, limit: int, offset: int) -> dict[str, Any]:
        """`CheckpointListResponse` for one training run, or all of them, oldest first."""
        if run is not None:
            self._training_run(run)
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
        """`CheckpointDownloadResponse`: a tar of the checkpoint directory, served here."""
        self._checkpoint(cuid)
        expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        return {
            "url": f"{self.files_url}/checkpoints/{cuid}.tar?token={self.download_token}",
            "expires_at": expires,
            "source": "object_storage",
            "checkpoint_status": "READY",
            "tls_cert_pem": None,
            "tls_not_after": None,
        }

    def archive(self, cuid: str) -> bytes:
        """The checkpoint directory as an uncompressed tar, its files at the top level."""
        directory = resolve_checkpoint(self._checkpoint(cuid).uri)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for path in sorted(directory.iterdir()):
                archive.add(path, arcname=path.name)
        return buffer.getvalue()

    def delete_checkpoint(self, cuid: str) -> None:
        """Delete a checkpoint's directory and record."""
        checkpoint = self._checkpoint(cuid)
        shutil.rmtree(resolve_checkpoint(checkpoint.uri), ignore_errors=True)
        with self._lock:
            self._checkpoints.pop(cuid, None)
