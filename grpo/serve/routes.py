"""The endpoints of `grpo serve`: a route table from (method, path) to the `ServeState`
operation, its fault-injection name and who may call it, plus the event and sample handlers.

Auth kinds: ``control`` (the API key, when the server has one), ``actor`` (a token that a
run's creation handed out), ``files`` (the download token in the URL), ``none`` (only
``/``, the reachability probe). Telemetry is accepted (with the key) and dropped.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
from pydantic import ValidationError as PydanticValidationError
from pytrio.errors.base import PyTrioError
from pytrio.protocol.actor.events.event import EVENT_PROTOCOL_VERSION, EventEnvelope, EventType
from pytrio.protocol.actor.sampling_run.sample import SampleRequest

from grpo.serve.state import ServeState
from grpo.serve.wire import API_KEY_INFO, ServeError, bootstrap, error_code

MAX_LONG_POLL_S = 20.0
SUBMIT_WAIT_S = 0.005
_HEARTBEAT_MS = 60_000
_EVENT_OPERATIONS = {
    EventType.TRAINER_INIT_RUN: "init_run",
    EventType.TRAINER_FORWARD: "forward",
    EventType.TRAINER_FORWARD_BACKWARD: "forward_backward",
    EventType.TRAINER_OPTIMIZE_STEP: "optimize_step",
    EventType.TRAINER_SAVE_STATE: "save_state",
    EventType.TRAINER_SAVE_WEIGHTS: "save_weights",
    EventType.TRAINER_END_RUN: "end_run",
}


@attrs.define
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (400 if it is not one)."""
        try:
            data = json.loads(self.body or b"{}")
        except ValueError as error:
            raise ServeError(
                400, "validation.invalid_request", f"body is not JSON: {error}"
            ) from None
        if not isinstance(data, dict):
            raise ServeError(400, "validation.invalid_request", "body must be a JSON object")
        return data

    def int_param(self, name: str, default: int) -> int:
        """Query parameter `name` as an int."""
        try:
            return int(self.query.get(name, default))
        except ValueError:
            raise ServeError(
                400, "validation.invalid_request", f"query {name} must be an int"
            ) from None


@attrs.define
class Reply:
    status: int
    body: Any = None  # dict -> JSON (or msgpack when `msgpack`), bytes -> as is, None -> empty
    msgpack: bool = False


Route = tuple[str, "re.Pattern[str]", str, str, Callable[..., Reply]]


def error_body(code: str, message: str, path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if path.startswith("/actor/"):
        body["error"] = {"code": code, "message": message}
    return body


def event_operation(request: Request) -> str:
    """The fault-injection name of a submitted event (`forward_backward`, ...), or `submit`."""
    try:
        kind = msgpack.unpackb(request.body, raw=False).get("type")
        return _EVENT_OPERATIONS[EventType(kind)]
    except Exception:  # noqa: BLE001 - a malformed body is refused later, with a 400
        return "submit"


# --- handlers ------------------------------------------------------------------------------


def _json(body: Any, status: int = 200) -> Reply:
    return Reply(status, body)


def _submit(state: ServeState, request: Request) -> Reply:
    try:
        raw = msgpack.unpackb(request.body, raw=False)
        envelope = EventEnvelope.model_validate(raw)
    except (ValueError, PydanticValidationError, msgpack.UnpackException) as error:
        raise ServeError(
            400, "validation.invalid_event", f"malformed event envelope: {error}"
        ) from None
    event = state.submit_event(envelope)
    # A quick event (optim_step, a save) answers with its result: one round trip, not two.
    concurrent.futures.wait([event.future], timeout=SUBMIT_WAIT_S)
    return Reply(200, _event_body(event, wait_s=0.0), msgpack=True)


def _get_event(
    stopping: threading.Event, state: ServeState, request: Request, event_id: str
) -> Reply:
    prefer = request.headers.get("Prefer") or ""
    match = re.search(r"wait=(\d+(?:\.\d+)?)", prefer)
    wait_s = min(float(match.group(1)), MAX_LONG_POLL_S) if match else 0.0
    event = state.event(event_id)
    deadline = time.monotonic() + wait_s
    while not event.future.done() and not stopping.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        concurrent.futures.wait([event.future], timeout=min(remaining, 0.5))
    return Reply(200, _event_body(event, wait_s=0.0), msgpack=True)


def _event_body(event: Any, *, wait_s: float) -> dict[str, Any]:
    """The `EventResponse` of an event: accepted/running, succeeded with its result, or failed."""
    base = {"version": EVENT_PROTOCOL_VERSION, "event_id": event.event_id, "type": event.type.value}
    if not event.future.done():
        return {**base, "status": "running"}
    error = event.future.exception(timeout=wait_s)
    usage = {"input_tokens": event.input_tokens, "output_tokens": 0, "train_tokens": 0}
    if error is not None:
        message = error.message if isinstance(error, (PyTrioError, ServeError)) else str(error)
        code = error.code if isinstance(error, ServeError) else error_code(error)
        return {
            **base,
            "status": "failed",
            "error": {"code": code, "message": message},
            "usage": usage,
        }
    result = event.future.result()
    if event.type == EventType.TRAINER_FORWARD_BACKWARD:
        usage["train_tokens"] = result["metrics"]["token_count"]
    return {**base, "status": "succeeded", "result": result, "usage": usage}


def _sample(state: ServeState, request: Request, run: str) -> Reply:
    try:
        sample_request = SampleRequest.model_validate(request.json())
    except PydanticValidationError as error:
        raise ServeError(400, "validation.invalid_sampling_request", str(error)) from None
    return _json(state.sample(run, sample_request))


def _archive(state: ServeState, request: Request, cuid: str) -> Reply:
    return Reply(200, state.archive(cuid))


def routes(stopping: threading.Event) -> list[Route]:
    """(method, path pattern, fault-injection operation, auth kind, handler) for every endpoint."""
    api, actor, ident = "/api/openapi/v1", "/actor/v1", r"([^/]+)"
    table: list[tuple[str, str, str, str, Callable[..., Reply]]] = [
        ("GET", "/", "", "none", lambda s, r: _json({"service": "grpo serve"})),
        ("HEAD", "/", "", "none", lambda s, r: Reply(200)),
        ("POST", "/api/telemetry/event", "", "control", lambda s, r: Reply(204)),
        (
            "GET",
            f"{api}/api-key/verify",
            "verify_api_key",
            "control",
            lambda s, r: _json(API_KEY_INFO),
        ),
        (
            "GET",
            "/api/sdk/bootstrap",
            "sdk_bootstrap",
            "control",
            lambda s, r: _json(bootstrap(r.query.get("sdk_version", ""))),
        ),
        (
            "GET",
            "/api/models",
            "list_models",
            "control",
            lambda s, r: _json(s.models(r.int_param("limit", 100), r.int_param("offset", 0))),
        ),
        (
            "POST",
            f"{api}/service-sessions",
            "create_service_session",
            "control",
            lambda s, r: _json(s.create_session()),
        ),
        (
            "GET",
            f"{api}/service-sessions",
            "list_service_sessions",
            "control",
            lambda s, r: _json(s.list_sessions(r.int_param("limit", 20), r.int_param("offset", 0))),
        ),
        (
            "GET",
            f"{api}/service-sessions/{ident}",
            "get_service_session",
            "control",
            lambda s, r, cuid: _json(s.get_session(cuid)),
        ),
        (
            "POST",
            f"{api}/service-sessions/{ident}/renew",
            "renew_service_session",
            "control",
            lambda s, r, cuid: _json(s.renew_session(cuid)),
        ),
        (
            "POST",
            f"{api}/service-sessions/{ident}/close",
            "close_service_session",
            "control",
            lambda s, r, cuid: (
                s.close_session(cuid, str(r.json().get("status", "ENDED"))),
                Reply(204),
            )[1],
        ),
        (
            "POST",
            f"{api}/service-sessions/{ident}/training-runs",
            "create_training_run",
            "control",
            lambda s, r, cuid: _json(s.create_training_run(cuid, r.json())),
        ),
        (
            "PATCH",
            f"{api}/service-sessions/{ident}/training-runs/{ident}",
            "update_training_run",
            "control",
            lambda s, r, _session, cuid: _json(s.update_training_run(cuid, r.json())),
        ),
        (
            "POST",
            f"{api}/service-sessions/{ident}/sampling-runs",
            "create_sampling_run",
            "control",
            lambda s, r, cuid: _json(s.create_sampling_run(cuid, r.json())),
        ),
        (
            "GET",
            f"{api}/training-runs/by-checkpoint-uri",
            "find_training_run_by_checkpoint_uri",
            "control",
            lambda s, r: _json(s.find_by_checkpoint(r.query.get("checkpoint_uri", ""))),
        ),
        (
            "GET",
            f"{api}/training-runs",
            "list_training_runs",
            "control",
            lambda s, r: _json(
                s.list_training_runs(r.int_param("limit", 20), r.int_param("offset", 0))
            ),
        ),
        (
            "GET",
            f"{api}/training-runs/{ident}",
            "get_training_run",
            "control",
            lambda s, r, cuid: _json(s.get_training_run(cuid)),
        ),
        (
            "GET",
            f"{api}/training-runs/{ident}/checkpoints",
            "list_training_run_checkpoints",
            "control",
            lambda s, r, cuid: _json(
                s.list_checkpoints(cuid, r.int_param("limit", 200), r.int_param("offset", 0))
            ),
        ),
        (
            "POST",
            f"{api}/training-runs/{ident}/renew",
            "renew_training_run",
            "control",
            lambda s, r, cuid: _json(s.renew_run(cuid, "training")),
        ),
        (
            "GET",
            f"{api}/sampling-runs/{ident}",
            "get_sampling_run",
            "control",
            lambda s, r, cuid: _json(s.get_sampling_run(cuid)),
        ),
        (
            "POST",
            f"{api}/sampling-runs/{ident}/renew",
            "renew_sampling_run",
            "control",
            lambda s, r, cuid: _json(s.renew_run(cuid, "sampling")),
        ),
        (
            "GET",
            f"{api}/checkpoints",
            "list_checkpoints",
            "control",
            lambda s, r: _json(
                s.list_checkpoints(None, r.int_param("limit", 100), r.int_param("offset", 0))
            ),
        ),
        (
            "GET",
            f"{api}/checkpoints/{ident}/download-url",
            "get_checkpoint_download_url",
            "control",
            lambda s, r, cuid: _json(s.download_url(cuid)),
        ),
        (
            "DELETE",
            f"{api}/checkpoints/{ident}",
            "delete_checkpoint",
            "control",
            lambda s, r, cuid: (s.delete_checkpoint(cuid), Reply(204))[1],
        ),
        ("POST", f"{actor}/events", "submit", "actor", _submit),
        (
            "GET",
            f"{actor}/events/{ident}",
            "get_event",
            "actor",
            lambda s, r, event_id: _get_event(stopping, s, r, event_id),
        ),
        (
            "POST",
            f"{actor}/client/heartbeat",
            "heartbeat",
            "actor",
            lambda s, r: _json({"heartbeat_ms": _HEARTBEAT_MS}),
        ),
        ("POST", f"{actor}/sampling-runs/{ident}/sample", "sample", "actor", _sample),
        ("GET", r"/files/checkpoints/([^/]+)\.tar", "download_checkpoint", "files", _archive),
    ]
    return [
        (method, re.compile(path), operation, auth, handler)
        for method, path, operation, auth, handler in table
    ]


OPERATIONS = sorted(
    {operation for _m, _p, operation, _a, _h in routes(threading.Event()) if operation} - {"submit"}
    | set(_EVENT_OPERATIONS.values()) - {"end_run"}
)
