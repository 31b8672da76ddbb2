"""Tinker's protocol in `grpo serve`: the ``/api/v1/`` endpoints the official ``tinker`` SDK
calls, on the same server, port and ``--api-key`` (sent as ``X-API-Key``) as PyTRIO's.

The handshake (``client/config``) keeps the SDK on plain API keys, client-side custom losses,
serial forward_backward chunks, uncompressed bodies, per-request polling and its default
(pyqwest) transport. Training, saving and sampling requests answer a future
(``{request_id, model_id}``) that ``retrieve_future`` long-polls: ``try_again`` while it
runs, its result when done (protobuf for forward_backward and sampling, JSON otherwise),
``{error, category}`` when it failed. A refused request is a 400 (404 for an unknown id)
naming the field: never a 5xx (the SDK retries those without limit) nor a 409 (retried for
minutes). State lives in
`grpo.serve.tinker_service`, the wire format in `grpo.serve.tinker_wire`.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pytrio.types import AdamParams, ModelInput

from grpo.backends.local import checkpoint_lora_spec, read_checkpoint_metadata, resolve_checkpoint
from grpo.serve.limits import MAX_FIELD_CHARS
from grpo.serve.messages import Reply, Request
from grpo.serve.tinker_rest import run_record, user_metadata, write_run_metadata
from grpo.serve.tinker_service import (
    MAX_LONG_POLL_S,
    Pending,
    TinkerModel,
    done,
    failure_body,
    running,
    submitted,
)
from grpo.serve.tinker_wire import (
    PROTO_CONTENT_TYPE,
    check_loss,
    decode_forward_backward,
    encode_forward_output,
    encode_sample,
    local_uri,
    tinker_path,
)
from grpo.serve.wire import ServeError, local_call, sampling_params

TINKER_PREFIX = "/api/v1/"
TINKER_KEY_PREFIX = "tml-"
"""What the SDK requires an API key to start with: the server also takes ``tml-KEY`` for KEY."""
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # plain API keys (X-API-Key), no JWT exchange
    "credential_default_source": "api_key",
    "custom_loss_server_side": False,  # forward_backward_custom runs its loss client-side
    "parallel_fwdbwd_chunks": False,  # chunks submitted one after another, in seq_id order
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    # the SDK's default transport (pyqwest, Rust's reqwest under httpx's API): it spends
    # about half the CPU per request of httpx's own, which an rl_loop step's ~22 requests
    # feel (benchmarks/README.md, "The Tinker route")
    "use_pyqwest_transport": True,
}
"""The flags the SDK's handshake gets (`tinker.types.ClientConfigResponse`)."""
_ADAM_KEYS = set(AdamParams.model_fields)


def tinker_exports(url: str, hub: Path, *, keyed: bool) -> list[str]:
    """The shell lines a Tinker program needs: the server's URL, the key in the form the SDK
    accepts (``tml-`` then the ``--api-key``), and the hub cache holding the served
    tokenizers (tinker-cookbook loads one by the model's name before its first request), read
    offline: online, the hub would be asked first (minutes of retries without a network) and
    could replace an alias's tokenizer with the real model's, whose ids the served one lacks."""
    key = f"{TINKER_KEY_PREFIX}<the key given to --api-key>" if keyed else "tml-local"
    return [
        f"export TINKER_BASE_URL={url}",
        f"export TINKER_API_KEY={key}",
        f"export HF_HUB_CACHE={hub / 'huggingface'}",
        "export HF_HUB_OFFLINE=1",
    ]


def _user_errors(endpoint: Callable[..., Reply]) -> Callable[..., Reply]:
    """`endpoint` with a 409 turned into a 400: the SDK retries a 409 for minutes."""

    @functools.wraps(endpoint)
    def wrapped(*args: Any) -> Reply:
        try:
            return endpoint(*args)
        except ServeError as error:
            if error.status == 409:
                raise ServeError(400, error.code, error.message) from None
            raise

    return wrapped


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> Reply:
    """An `UntypedAPIFuture` reply."""
    body = {"request_id": request_id, **extra}
    if model_id is not None:
        body["model_id"] = model_id
    return Reply(200, body)


def _bad(field: str, what: str) -> ServeError:
    return ServeError(400, "validation.invalid_request", f"{field} must be {what}")


def _text(body: dict[str, Any], field: str, *, required: bool = True) -> str | None:
    """The body's string `field` (None when absent and not `required`); 400 naming it."""
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS:
        raise _bad(field, f"a non-empty string of at most {MAX_FIELD_CHARS} characters")
    return value


def _int(body: dict[str, Any], field: str, label: str = "") -> int | None:
    """The body's integer `field`, or None when absent; 400 naming it."""
    value = body.get(field)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise _bad(label or field, "an integer")
    return value


def _flag(body: dict[str, Any], field: str, default: bool, label: str = "") -> bool:
    """The body's boolean `field` (`default` when absent); 400 naming it."""
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(label or field, "true or false")
    return value


def _object(body: dict[str, Any], field: str) -> dict[str, Any] | None:
    """The body's object `field`, or None when absent; 400 naming it."""
    value = body.get(field)
    if value is not None and not isinstance(value, dict):
        raise _bad(field, "an object")
    return value


def _prompt_tokens(prompt: dict[str, Any] | None) -> list[int]:
    """The token ids of a JSON `ModelInput` (text chunks only); 400 naming what is wrong."""
    chunks = (prompt or {}).get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise _bad("prompt.chunks", "a non-empty list of encoded_text chunks")
    parts = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise ServeError(
                400,
                "validation.image_unsupported",
                f"prompt.chunks[{index}]: text chunks (encoded_text) only on this server",
            )
        tokens = chunk.get("tokens")
        try:
            array = np.asarray(tokens if isinstance(tokens, list) else None)
        except (ValueError, OverflowError):  # ragged or out of range
            array = np.asarray(None)
        if array.ndim != 1 or array.dtype.kind not in "iu" or (array.size and array.min() < 0):
            raise _bad(f"prompt.chunks[{index}].tokens", "a list of token ids (integers >= 0)")
        parts.append(array.astype(np.int64))
    return np.concatenate(parts).tolist()


# --- handshake, sessions, capabilities ---------------------------------------------------


@_user_errors
def client_config(state: Any, request: Request) -> Reply:
    """`ClientConfigResponse`: the flags above."""
    request.json()
    return Reply(200, CLIENT_CONFIG)


@_user_errors
def client_dynamic_config(state: Any, request: Request) -> Reply:
    """`ClientDynamicConfigResponse`: no server-side cancellation."""
    return Reply(200, {"refresh_interval_sec": 300, "sample_cancel_enabled": False})


@_user_errors
def health(state: Any, request: Request) -> Reply:
    """`HealthResponse`."""
    return Reply(200, {"status": "ok"})


@_user_errors
def telemetry(state: Any, request: Request) -> Reply:
    """`TelemetryResponse`: accepted, dropped."""
    return Reply(200, {"status": "accepted"})


@_user_errors
def create_session(state: Any, request: Request) -> Reply:
    """`CreateSessionResponse`."""
    request.json()
    return Reply(200, {"type": "create_session", "session_id": state.tinker.create_session()})


@_user_errors
def session_heartbeat(state: Any, request: Request) -> Reply:
    """`SessionHeartbeatResponse`; 410 for a finished or expired session (the SDK's signal to
    stop heartbeating it)."""
    state.tinker.heartbeat(_text(request.json(), "session_id"))
    return Reply(200, {"type": "session_heartbeat"})


@_user_errors
def finish_session(state: Any, request: Request, session_id: str) -> Reply:
    """Finish a session (its training clients are freed); empty 200."""
    state.tinker.finish_session(session_id)
    return Reply(200)


@_user_errors
def server_capabilities(state: Any, request: Request) -> Reply:
    """`GetServerCapabilitiesResponse`: every served model and alias, trainable and sampleable."""
    catalogue = state.registry.catalogue
    models = []
    for name in catalogue.names():
        limits = catalogue.limits(catalogue.resolve(name)[0])
        models.append(
            {
                "model_name": name,
                "max_context_length": limits["max_seq_len"],
                "trainable": True,
                "sampleable": True,
            }
        )
    return Reply(200, {"supported_models": models})


# --- training ------------------------------------------------------------------------------


@_user_errors
def create_model(state: Any, request: Request) -> Reply:
    """A LoRA training client (Adam only); its future resolves to `CreateModelResponse`."""
    body = request.json()
    state.tinker.session(_text(body, "session_id"))
    base_model = _text(body, "base_model")
    optimizer = _object(body, "optimizer_config") or {"type": "adamw"}
    kind = optimizer.get("type")
    if kind != "adamw":
        raise ServeError(
            400,
            "validation.unsupported_optimizer",
            f"optimizer_config.type {kind!r:.40} is not served: grpo serve trains with Adam "
            "only (optimizer_config type 'adamw', the SDK's default)",
        )
    lora = _object(body, "lora_config")
    if lora is None:
        raise ServeError(
            400,
            "validation.invalid_request",
            "lora_config is required: grpo serve trains LoRA adapters only",
        )
    model_id = _model_id(body)
    existing = state.tinker.find_model(model_id)
    if existing is not None:  # a retried create_model: the same training client
        return _future(existing.created, model_id)
    metadata = user_metadata(body)
    name, _ = state.registry.catalogue.resolve(base_model)
    client = local_call(
        lambda: state.registry.local.create_lora_training_client(
            name,
            rank=_int(lora, "rank", "lora_config.rank") or 32,
            seed=_int(lora, "seed", "lora_config.seed"),
            train_mlp=_flag(lora, "train_mlp", True, "lora_config.train_mlp"),
            train_attn=_flag(lora, "train_attn", True, "lora_config.train_attn"),
            train_unembed=_flag(lora, "train_unembed", True, "lora_config.train_unembed"),
            service_normalization="sum",
        )
    )
    client.training_run_cuid = model_id  # its saves go to <root>/MODEL_ID/...
    write_run_metadata(state.registry.root, model_id, base_model, metadata)
    request_id = state.tinker.add_future(done({"model_id": model_id, "type": "create_model"}))
    model = TinkerModel(model_id, base_model, client.lora.rank, client, body["session_id"])
    model.created, model.user_metadata = request_id, metadata
    state.tinker.add_model(model)
    return _future(request_id, model_id)


def _model_id(body: dict[str, Any]) -> str:
    """The id the SDK computes for its training client: ``SESSION:train:MODEL_SEQ_ID``."""
    seq = _int(body, "model_seq_id")
    if seq is None:
        raise ServeError(400, "validation.invalid_request", "model_seq_id must be an integer")
    return f"{body['session_id']}:train:{seq}"


@_user_errors
def get_info(state: Any, request: Request) -> Reply:
    """`GetInfoResponse` of a training client."""
    model = state.tinker.model(_text(request.json(), "model_id"))
    return Reply(
        200,
        {
            "type": "get_info",
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model},
            "model_id": model.model_id,
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": model.base_model,
        },
    )


@_user_errors
def forward_backward(state: Any, request: Request) -> Reply:
    """A protobuf forward or forward_backward, in seq_id order; built-in losses only."""
    if (request.headers.get("Content-Encoding") or "identity") != "identity":
        raise ServeError(
            400,
            "validation.invalid_request",
            "Content-Encoding is not served on forward_backward; send the protobuf body as is",
        )
    parsed = decode_forward_backward(request.body)
    model = state.tinker.model(parsed["model_id"])

    def start() -> Pending:
        check_loss(parsed["loss_fn"], parsed["loss_fn_config"])
        call = model.client.forward if parsed["forward_only"] else model.client.forward_backward
        args = (parsed["data"], parsed["loss_fn"], parsed["loss_fn_config"])
        return running(call(*args), encode_forward_output, proto=True)

    request_id = state.tinker.in_order(model, parsed["seq_id"] or None, submitted(start))
    return _future(request_id, model.model_id)


@_user_errors
def optim_step(state: Any, request: Request) -> Reply:
    """One Adam step (any other optimizer's parameters are refused by name)."""
    body = request.json()
    model = state.tinker.model(_text(body, "model_id"))
    if "adam_params" not in body:
        raise ServeError(
            400,
            "validation.unsupported_optimizer",
            "optimizer_params: grpo serve trains with Adam only; pass adam_params",
        )
    params = _object(body, "adam_params")
    if params is None or set(params) - _ADAM_KEYS:
        raise ServeError(
            400,
            "validation.invalid_request",
            f"adam_params must be an object with keys among {sorted(_ADAM_KEYS)}",
        )

    def start() -> Pending:
        adam = AdamParams(**params)
        return running(model.client.optim_step(adam), lambda out: {"metrics": dict(out.metrics)})

    request_id = state.tinker.in_order(model, _int(body, "seq_id"), submitted(start))
    return _future(request_id, model.model_id)


# --- weights -------------------------------------------------------------------------------


@_user_errors
def save_weights(state: Any, request: Request) -> Reply:
    """Weights and optimizer state under ``tinker://MODEL/weights/NAME``."""
    body = request.json()
    model = state.tinker.model(_text(body, "model_id"))
    name = _text(body, "path", required=False) or f"state-{uuid.uuid4().hex[:8]}"
    overwrite = _flag(body, "overwrite", False)
    ttl = _int(body, "ttl_seconds")

    def start() -> Pending:
        saved = model.client.save_state(name, ttl, overwrite)
        path = tinker_path(model.model_id, "state", name)
        return running(saved, lambda _: {"path": path, "type": "save_weights"})

    request_id = state.tinker.in_order(model, _int(body, "seq_id"), submitted(start))
    return _future(request_id, model.model_id)


@_user_errors
def save_weights_for_sampler(state: Any, request: Request) -> Reply:
    """Named: sampler weights under ``tinker://MODEL/sampler_weights/NAME``. Unnamed
    (``save_weights_and_get_sampling_client``): a sampling session on the current weights."""
    body = request.json()
    model = state.tinker.model(_text(body, "model_id"))
    name = _text(body, "path", required=False)
    kind = "save_weights_for_sampler"
    ttl = _int(body, "ttl_seconds")
    if body.get("kind", "snapshot") != "snapshot":
        raise _bad("kind", "'snapshot' (inflight sampling clients are not served yet)")

    def start() -> Pending:
        if name is None:
            sampler = model.client.save_weights_and_get_sampling_client()
            session = state.tinker.add_sampler(
                sampler, model.base_model, None, model.session_id, model.model_id
            )
            return done({"sampling_session_id": session, "type": kind})
        saved = model.client.save_weights_for_sampler(name, ttl)
        path = tinker_path(model.model_id, "sampler", name)
        return running(saved, lambda _: {"path": path, "type": kind})

    request_id = state.tinker.in_order(model, _int(body, "seq_id"), submitted(start))
    return _future(request_id, model.model_id)


@_user_errors
def load_weights(state: Any, request: Request) -> Reply:
    """Load ``tinker://.../weights/NAME`` (with or without the optimizer) into a training
    client, or make a new one from it (``session_id`` + ``model_seq_id``)."""
    body = request.json()
    path = _text(body, "path")
    uri = local_uri(path, state.registry.root)
    with_optimizer = _flag(body, "optimizer", False)
    asked_base = _text(body, "base_model", required=False)
    if body.get("model_id") is None:
        state.tinker.session(_text(body, "session_id"))
        model_id = _model_id(body)
        existing = state.tinker.find_model(model_id)
        if existing is not None:  # a retried load_weights: the same training client
            return _future(existing.created, model_id)
        asked_metadata = user_metadata(body)
        directory = local_call(lambda: resolve_checkpoint(uri))
        metadata = local_call(lambda: read_checkpoint_metadata(directory))
        spec = checkpoint_lora_spec(metadata)
        name, _ = state.registry.catalogue.resolve(asked_base or str(metadata["base_model"]))
        source_run = path.removeprefix("tinker://").split("/")[0]
        # reported as the source run's client named it (an alias too), else as the checkpoint
        base = asked_base or run_record(state.registry.root, source_run)["base_model"] or name
        client = local_call(
            lambda: state.registry.local.create_lora_training_client(
                name,
                rank=spec.rank,
                seed=spec.seed,
                train_mlp=spec.train_mlp,
                train_attn=spec.train_attn,
                train_unembed=spec.train_unembed,
                service_normalization="sum",
            )
        )
        client.training_run_cuid = model_id
        model = TinkerModel(model_id, base, spec.rank, client, body["session_id"])
        model.user_metadata = asked_metadata
        write_run_metadata(state.registry.root, model_id, base, model.user_metadata)
        seq_id = None
    else:
        model = state.tinker.model(_text(body, "model_id"))
        seq_id = _int(body, "seq_id")

    def start() -> Pending:
        load = model.client.load_state_with_optimizer if with_optimizer else model.client.load_state
        reply = {"path": path, "model_id": model.model_id, "type": "load_weights"}
        return running(load(uri), lambda _: reply)

    request_id = state.tinker.in_order(model, seq_id, submitted(start))
    if seq_id is None:
        model.created = request_id
        state.tinker.add_model(model)
    return _future(request_id, model.model_id)


# --- sampling ------------------------------------------------------------------------------


def _sampler(state: Any, base_model: str | None, model_path: str | None) -> tuple[Any, str]:
    """The sampler of `model_path` (a ``tinker://`` path) or of `base_model`."""
    if model_path:
        uri = local_uri(model_path, state.registry.root, "model_path")
        metadata = local_call(lambda: read_checkpoint_metadata(resolve_checkpoint(uri)))
        return state.registry.sampler(uri), str(metadata["base_model"])
    if not base_model:
        raise ServeError(400, "validation.invalid_request", "base_model or model_path is required")
    state.registry.catalogue.resolve(base_model)  # 404 naming base_model when not served
    return state.registry.sampler(base_model), base_model


@_user_errors
def create_sampling_session(state: Any, request: Request) -> Reply:
    """`CreateSamplingSessionResponse` for a base model or ``tinker://`` sampler weights."""
    body = request.json()
    state.tinker.session(_text(body, "session_id"))
    model_path = _text(body, "model_path", required=False)
    sampler, base = _sampler(state, _text(body, "base_model", required=False), model_path)
    session = state.tinker.add_sampler(sampler, base, model_path, body["session_id"])
    return Reply(200, {"type": "create_sampling_session", "sampling_session_id": session})


@_user_errors
def get_sampler(state: Any, request: Request, sampler_id: str) -> Reply:
    """`GetSamplerResponse`."""
    _sampler_client, base, path = state.tinker.sampler(sampler_id)
    return Reply(200, {"sampler_id": sampler_id, "base_model": base, "model_path": path})


@_user_errors
def asample(state: Any, request: Request) -> Reply:
    """Sample (or score the prompt, ``compute_logprobs``); the future resolves to a protobuf
    `SampleResponse` whose sequences keep their stop token."""
    body = request.json()
    session = _text(body, "sampling_session_id", required=False)
    if session is not None:
        sampler = state.tinker.sampler(session)[0]
    else:
        base_model = _text(body, "base_model", required=False)
        sampler = _sampler(state, base_model, _text(body, "model_path", required=False))[0]
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if _int(body, field):
            raise _bad(field, "0 (not served yet)")
    if body.get("target_prompt_logprobs"):
        raise _bad("target_prompt_logprobs", "absent (not served yet)")
    if body.get("record_stability_info"):  # what tinker-cookbook asks for under its default loss
        raise ServeError(
            400,
            "validation.unsupported_loss",
            "record_stability_info is not served: it records what loss_fn='stable_reinforce' "
            "trains on, and that objective is not public; pass loss_fn=importance_sampling "
            "(in tinker-cookbook: loss_fn=importance_sampling)",
        )
    tokens = _prompt_tokens(_object(body, "prompt"))
    num_samples = _int(body, "num_samples") or 1
    with_prompt = _flag(body, "prompt_logprobs", False)
    raw = _object(body, "sampling_params") or {}
    raw_params = {key: value for key, value in raw.items() if value is not None}
    params = sampling_params(raw_params)
    last_n = _int(body, "prompt_logprobs_last_n")

    def finish(response: Any) -> bytes:
        logprobs = list(response.prompt_logprobs) if with_prompt else None
        if logprobs is not None and last_n:
            logprobs = [None] * (len(logprobs) - last_n) + logprobs[-last_n:]
        return encode_sample(response, logprobs)

    def start() -> Pending:
        prompt = ModelInput.from_ints(tokens)
        future = local_call(lambda: sampler.sample(prompt, num_samples, params, with_prompt))
        return running(future, finish, proto=True)

    seq_id = _int(body, "seq_id")
    key = None if session is None or seq_id is None else (session, seq_id)
    request_id = state.tinker.sample_once(key, start, session)
    ids = [f"{request_id}-{index}" for index in range(num_samples)]
    return _future(request_id, None, sample_sequence_ids=ids)


# --- futures -------------------------------------------------------------------------------


@_user_errors
def retrieve_future(state: Any, request: Request) -> Reply:
    """The future's result once done (long poll), ``try_again`` while it runs, or the
    failure as a finished future ``{error, category}``."""
    request_id = _text(request.json(), "request_id")
    pending, finished = state.tinker.poll(request_id, MAX_LONG_POLL_S)
    if not finished:
        return Reply(200, {"type": "try_again", "request_id": request_id, "queue_state": "active"})
    error = pending.future.exception()
    if error is not None:
        return Reply(200, failure_body(error))
    result = pending.future.result()
    if pending.proto:
        if PROTO_CONTENT_TYPE not in (request.headers.get("Accept") or ""):
            raise ServeError(
                400,
                "validation.invalid_request",
                f"this result is protobuf: send Accept: {PROTO_CONTENT_TYPE}",
            )
        return Reply(200, result, content_type=PROTO_CONTENT_TYPE)
    return Reply(200, result)
