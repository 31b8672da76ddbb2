"""Wire helpers of `grpo serve`: its error type, its run records, and conversions between
pytrio's wire models and the local backend's types (no state, no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import numpy as np
from pytrio.errors.base import PyTrioError
from pytrio.protocol.actor.events.event import EventType
from pytrio.protocol.actor.events.tensor import WireTensorData
from pytrio.protocol.actor.model_input import WireEncodedTextChunk
from pytrio.types import Datum, ModelInput, SamplingParams, TensorData

from grpo.backends.local import LocalSamplingClient, LocalTrainingClient

SAMPLING_PARAM_KEYS = {
    "max_tokens",
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "stop",
    "stop_token_ids",
}


class ServeError(Exception):
    """A request the server refuses: HTTP `status`, PyTRIO error `code`, and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def now_iso() -> str:
    """The current UTC time as ISO 8601 (what pydantic parses into an aware datetime)."""
    return datetime.now(UTC).isoformat()


def error_code(error: BaseException) -> str:
    """The PyTRIO code of a local-backend error (its own code, else validation/internal)."""
    if isinstance(error, PyTrioError):
        return error.code
    return (
        "validation.invalid_request"
        if isinstance(error, (ValueError, TypeError, KeyError))
        else "trainer.error"
    )


def not_found(what: str, key: str) -> ServeError:
    return ServeError(404, "not_found", f"{what} {key!r} does not exist on this server")


@attrs.define
class TrainingRun:
    """A training run: its LoRA config, its model, and its trainer once `init_run` made it."""

    cuid: str
    session: str
    base_model: str
    model_id: str
    lora: dict[str, Any]  # as requested, under PyTRIO's names (`lora_wire_fields`)
    source_checkpoint_uri: str
    restore_optimizer: bool
    created_at: str
    updated_at: str
    client: LocalTrainingClient | None = None
    ended: bool = False  # trainer.end_run (pytrio 0.2.0/0.2.1's TrainingClient.close) came


@attrs.define
class SamplingRun:
    """A sampling run and the local sampler it samples from."""

    cuid: str
    session: str
    base_model: str
    model_id: str
    source_checkpoint_uri: str
    created_at: str
    client: LocalSamplingClient


@attrs.define
class CheckpointRecord:
    """A named checkpoint saved through the server (RestClient lists these)."""

    cuid: str
    run: str
    name: str
    checkpoint_type: str  # "TRAINING" (save_state) or "SAMPLER" (save_weights_for_sampler)
    uri: str
    size_bytes: int
    created_at: str
    ttl_seconds: int | None


@attrs.define
class Event:
    """A submitted trainer event; `future` resolves to its result dict."""

    event_id: str
    type: EventType
    future: Future  # resolves to the event's result dict
    input_tokens: int = 0


API_KEY_INFO: dict[str, Any] = {
    "api_key_tid": "local",
    "api_key_name": "grpo serve",
    "user_cuid": "local-user",
    "username": "local",
    "display_name": "grpo serve",
    "workspace_cuid": "local-workspace",
    "workspace_name": "local",
    "workspace_type": "personal",
    "expires_at": None,
}
"""`APIKeyInfo` for any accepted key: one local user and workspace."""


def bootstrap(sdk_version: str) -> dict[str, Any]:
    """`SDKBootstrapResponse`: every SDK version is compatible, no notices."""
    return {"compatibility": {"status": "compatible", "sdk_version": sdk_version}, "notices": []}


def model_list(
    supported: list[Any], aliases: dict[str, str], limit: int, offset: int
) -> dict[str, Any]:
    """`ModelListResponse` of pytrio `SupportedModel`s, each alias listed like its model."""
    by_name = {model.model_name: model for model in supported}
    served = [(model.model_name, model) for model in supported]
    served += [(alias, by_name[name]) for alias, name in aliases.items()]

    def runner(operation: Any) -> dict[str, Any]:
        return {
            "max_batch_size": operation.max_batch_size,
            "max_tokens_per_request": operation.max_tokens_per_request,
            "max_seq_len": operation.max_seq_len,
        }

    items = [
        {
            "cuid": f"model-{name}",
            "alias": name,
            "model_id": name,
            "display_name": name,
            "description": f"{model.model_name}, served by grpo serve (local backend)",
            "context_length": model.max_context_length,
            "train_available": model.training.available,
            "sample_available": model.sampling.available,
            "trainer": runner(model.training),
            "sampler": runner(model.sampling),
            "created_at": now_iso(),
            "updated_at": now_iso(),
        }
        for name, model in served
    ]
    return {
        "items": items[offset : offset + limit],
        "total": len(items),
        "limit": limit,
        "offset": offset,
    }


def training_run_record(run: TrainingRun) -> dict[str, Any]:
    """`TrainingRunGetResponse` of a run."""
    params = {"restore_optimizer": run.restore_optimizer, **run.lora}
    return {
        "training_run_cuid": run.cuid,
        "base_model": run.base_model,
        "service_session_cuid": run.session,
        "workspace_cuid": "local-workspace",
        "status": "ACTIVE",
        "run_index": 1,
        "model_spec_cuid": f"model-{run.base_model}",
        "is_lora": True,
        "source_checkpoint_uri": run.source_checkpoint_uri or None,
        **params,
        "corrupted": False,
        "training_params": params,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
    }


def checkpoint_record(checkpoint: CheckpointRecord, run: TrainingRun | None) -> dict[str, Any]:
    """`CheckpointResponse` of a checkpoint saved by `run` (None once the run is unknown)."""
    base_model = run.base_model if run is not None else ""
    expires = None
    if checkpoint.ttl_seconds:
        created = datetime.fromisoformat(checkpoint.created_at)
        expires = (created + timedelta(seconds=checkpoint.ttl_seconds)).isoformat()
    return {
        "cuid": checkpoint.cuid,
        "checkpoint_cuid": checkpoint.cuid,
        "training_run_cuid": checkpoint.run,
        "workspace_cuid": "local-workspace",
        "name": checkpoint.name,
        "checkpoint_type": checkpoint.checkpoint_type,
        "status": "READY",
        "checkpoint_uri": checkpoint.uri,
        "model": base_model,
        "base_model": base_model,
        "model_spec_cuid": f"model-{base_model}",
        "task_id": checkpoint.run,
        "task_created_at": run.created_at if run else checkpoint.created_at,
        "task_status": "ACTIVE",
        "path": checkpoint.uri,
        "created_at": checkpoint.created_at,
        "uploaded_at": checkpoint.created_at,
        "size_bytes": checkpoint.size_bytes,
        "lora_rank": run.lora["lora_rank"] if run else 0,
        "is_uploaded": True,
        "expired_at": expires,
    }


def local_call(call: Callable[[], Any]) -> Any:
    """Run a local-backend call; its validation errors become 400s naming the field."""
    try:
        return call()
    except ServeError:
        raise
    except Exception as error:  # noqa: BLE001 - local validation errors of several types
        if isinstance(error, (PyTrioError, ValueError, TypeError, KeyError)):
            message = error.message if isinstance(error, PyTrioError) else str(error)
            raise ServeError(400, error_code(error), message) from None
        raise


def chain(source: Any, target: Future, convert: Callable[[Any], Any]) -> None:
    """Resolve `target` with `convert(result)` (or the error) when APIFuture `source` is done."""

    def resolve(done: Future) -> None:
        try:
            target.set_result(convert(done.result()))
        except BaseException as error:  # noqa: BLE001 - the event carries any failure
            target.set_exception(error)

    source._future.add_done_callback(resolve)


def datum_from_wire(item: Any) -> Datum:
    """The local backend's Datum from one wire `TrainerForwardDatum` (text chunks only)."""
    tokens: list[int] = []
    for chunk in item.model_input.chunks:
        if not isinstance(chunk, WireEncodedTextChunk):
            raise ServeError(
                400, "validation.image_unsupported", "the local backend trains on text only"
            )
        tokens.extend(chunk.tokens)
    inputs: dict[str, TensorData] = {
        "target_tokens": TensorData(
            data=list(item.target_ids), dtype="int64", shape=[len(item.target_ids)]
        )
    }
    for key in ("weights", "logprobs", "advantages"):
        values = getattr(item, key)
        if values is not None:
            inputs[key] = TensorData(data=list(values), dtype="float32", shape=[len(values)])
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def forward_result(output: Any) -> dict[str, Any]:
    """`TrainerForwardResult` of a ForwardBackwardOutput: wire-tensor logprobs, pytrio's metrics."""
    outputs = [
        {
            name: WireTensorData.from_numpy(
                np.asarray(tensor.data, dtype=np.float32)
            ).to_wire_value()
            for name, tensor in sample.items()
        }
        for sample in output.loss_fn_outputs
    ]
    metrics = output.metrics
    return {
        "loss_fn_outputs": outputs,
        "metrics": {
            "loss_sum": float(metrics["loss_sum"]),
            "loss_mean": float(metrics["loss_mean"]),
            "token_count": int(metrics["token_count"]),
        },
    }


def sampling_params(raw: dict[str, object]) -> SamplingParams:
    """pytrio's SamplingParams from the wire dict (stop strings and stop token ids merged back)."""
    unknown = set(raw) - SAMPLING_PARAM_KEYS
    if unknown:
        raise ServeError(
            400,
            "validation.invalid_sampling_request",
            f"sampling_params has unknown keys {sorted(unknown)}; "
            f"known: {sorted(SAMPLING_PARAM_KEYS)}",
        )
    fields = {key: value for key, value in raw.items() if key not in ("stop", "stop_token_ids")}
    stop = raw.get("stop_token_ids", raw.get("stop"))
    try:
        return SamplingParams(**fields, stop=stop)  # type: ignore[arg-type]
    except ValueError as error:
        raise ServeError(400, "validation.invalid_sampling_request", str(error)) from None
