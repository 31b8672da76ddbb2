"""The endpoints of `grpo serve`: one function per operation, from a `Request` to a `Reply`.

Each decodes its request (the path's ids come as extra arguments), calls the run registry,
the trainer events or the sampler, and wraps the response; `grpo.serve.routes` maps paths
to them. Telemetry is accepted and dropped.
"""

from __future__ import annotations

import re

import attrs
import msgpack
from pydantic import ValidationError as PydanticValidationError
from pytrio.protocol.actor.events.event import EventEnvelope
from pytrio.protocol.actor.sampling_run.sample import SampleRequest
from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest
from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest
from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest

from grpo.serve.compat import upgrade_sample_request
from grpo.serve.events import TrainerEvents
from grpo.serve.messages import Reply, Request, field_errors
from grpo.serve.registry import RunRegistry
from grpo.serve.sampling import sample
from grpo.serve.tinker_service import TinkerService
from grpo.serve.wire import API_KEY_INFO, ServeError, bootstrap

_HEARTBEAT_MS = 60_000


@attrs.frozen
class ServeState:
    """What the endpoints serve: the run registry, the trainer events on its runs, and the
    Tinker route's sessions, models and futures."""

    registry: RunRegistry
    events: TrainerEvents
    tinker: TinkerService


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    return request.int_param("limit", default_limit), request.int_param("offset", 0)


# --- reachability, identity, models --------------------------------------------------------


def probe(state: ServeState, request: Request) -> Reply:
    """``GET /``: the service's name."""
    return Reply(200, {"service": "grpo serve"})


def probe_head(state: ServeState, request: Request) -> Reply:
    """``HEAD /``: an empty 200."""
    return Reply(200)


def drop_telemetry(state: ServeState, request: Request) -> Reply:
    """Telemetry: accepted, dropped."""
    return Reply(204)


def verify_api_key(state: ServeState, request: Request) -> Reply:
    """`APIKeyInfo` of the (accepted) key."""
    return Reply(200, API_KEY_INFO)


def sdk_bootstrap(state: ServeState, request: Request) -> Reply:
    """`SDKBootstrapResponse` for the SDK version asked about."""
    return Reply(200, bootstrap(request.query.get("sdk_version", "")))


def list_models(state: ServeState, request: Request) -> Reply:
    """`ModelListResponse`."""
    return Reply(200, state.registry.catalogue.models(*_page(request, 100)))


# --- service sessions ----------------------------------------------------------------------


def create_session(state: ServeState, request: Request) -> Reply:
    """`ServiceSessionCreateResponse`."""
    return Reply(200, state.registry.create_session())


def list_sessions(state: ServeState, request: Request) -> Reply:
    """`ServiceSessionListResponse`."""
    return Reply(200, state.registry.list_sessions(*_page(request, 20)))


def get_session(state: ServeState, request: Request, cuid: str) -> Reply:
    """`ServiceSessionGetResponse`."""
    return Reply(200, state.registry.get_session(cuid))


def renew_session(state: ServeState, request: Request, cuid: str) -> Reply:
    """`ServiceSessionRenewResponse`."""
    return Reply(200, state.registry.renew_session(cuid))


def close_session(state: ServeState, request: Request, cuid: str) -> Reply:
    """Close a session with the body's status (ENDED, the default, or CANCELLED); 204."""
    status = request.json().get("status", "ENDED")
    if status not in ("ENDED", "CANCELLED"):
        raise ServeError(
            400,
            "validation.invalid_request",
            f"status must be ENDED or CANCELLED, got {status!r:.80}",
        )
    state.registry.close_session(cuid, status)
    return Reply(204)


# --- training and sampling runs ------------------------------------------------------------


def create_training_run(state: ServeState, request: Request, session: str) -> Reply:
    """`TrainingRunCreateResponse`."""
    body = request.model(TrainingRunCreateRequest).model_dump()
    return Reply(200, state.registry.create_training_run(session, body))


def update_training_run(state: ServeState, request: Request, session: str, cuid: str) -> Reply:
    """`TrainingRunUpdateResponse` (the session in the path is not checked)."""
    body = request.model(TrainingRunUpdateRequest).model_dump()
    return Reply(200, state.registry.update_training_run(cuid, body))


def create_sampling_run(state: ServeState, request: Request, session: str) -> Reply:
    """`SamplingRunCreateResponse`."""
    body = request.model(SamplingRunCreateRequest).model_dump()
    return Reply(200, state.registry.create_sampling_run(session, body))


def find_by_checkpoint(state: ServeState, request: Request) -> Reply:
    """`TrainingRunByCheckpointURIResponse` of the ``checkpoint_uri`` query."""
    return Reply(200, state.registry.find_by_checkpoint(request.text_param("checkpoint_uri")))


def list_training_runs(state: ServeState, request: Request) -> Reply:
    """`TrainingRunListResponse`."""
    return Reply(200, state.registry.list_training_runs(*_page(request, 20)))


def get_training_run(state: ServeState, request: Request, cuid: str) -> Reply:
    """`TrainingRunGetResponse`."""
    return Reply(200, state.registry.get_training_run(cuid))


def renew_training_run(state: ServeState, request: Request, cuid: str) -> Reply:
    """`TrainingRunRenewResponse`."""
    return Reply(200, state.registry.renew_run(cuid, "training"))


def get_sampling_run(state: ServeState, request: Request, cuid: str) -> Reply:
    """`SamplingRunGetResponse`."""
    return Reply(200, state.registry.get_sampling_run(cuid))


def renew_sampling_run(state: ServeState, request: Request, cuid: str) -> Reply:
    """`SamplingRunRenewResponse`."""
    return Reply(200, state.registry.renew_run(cuid, "sampling"))


# --- checkpoints (RestClient) --------------------------------------------------------------


def list_run_checkpoints(state: ServeState, request: Request, cuid: str) -> Reply:
    """`CheckpointListResponse` of one training run."""
    return Reply(200, state.registry.list_checkpoints(cuid, *_page(request, 200)))


def list_checkpoints(state: ServeState, request: Request) -> Reply:
    """`CheckpointListResponse` of every training run."""
    return Reply(200, state.registry.list_checkpoints(None, *_page(request, 100)))


def download_url(state: ServeState, request: Request, cuid: str) -> Reply:
    """`CheckpointDownloadResponse`."""
    return Reply(200, state.registry.download_url(cuid))


def delete_checkpoint(state: ServeState, request: Request, cuid: str) -> Reply:
    """Delete a checkpoint; 204."""
    state.registry.delete_checkpoint(cuid)
    return Reply(204)


def download_checkpoint(state: ServeState, request: Request, cuid: str) -> Reply:
    """The checkpoint's tar archive."""
    return Reply(200, state.registry.archive(cuid))


# --- Actor API -----------------------------------------------------------------------------


def submit_event(state: ServeState, request: Request) -> Reply:
    """`EventResponse` of a submitted msgpack `EventEnvelope` (400 if malformed)."""
    try:
        raw = msgpack.unpackb(request.body, raw=False)
        envelope = EventEnvelope.model_validate(raw)
    except PydanticValidationError as error:
        raise ServeError(
            400, "validation.invalid_event", f"malformed event envelope: {field_errors(error)}"
        ) from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ServeError(
            400, "validation.invalid_event", f"body is not a msgpack event envelope: {error}"
        ) from None
    return Reply(200, state.events.submit(envelope), msgpack=True)


def get_event(state: ServeState, request: Request, event_id: str) -> Reply:
    """`EventResponse` of an event, long-polled for ``Prefer: wait=N`` seconds."""
    match = re.search(r"wait=(\d+(?:\.\d+)?)", request.headers.get("Prefer") or "")
    wait_s = float(match.group(1)) if match else 0.0
    return Reply(200, state.events.poll(event_id, wait_s), msgpack=True)


def heartbeat(state: ServeState, request: Request) -> Reply:
    """The heartbeat interval the client should keep."""
    return Reply(200, {"heartbeat_ms": _HEARTBEAT_MS})


def sample_request(state: ServeState, request: Request, cuid: str) -> Reply:
    """`ActorSampleResponse` of a JSON `SampleRequest`."""
    try:
        parsed = SampleRequest.model_validate(upgrade_sample_request(request.json()))
    except PydanticValidationError as error:
        raise ServeError(400, "validation.invalid_sampling_request", field_errors(error)) from None
    return Reply(200, sample(state.registry, cuid, parsed))
