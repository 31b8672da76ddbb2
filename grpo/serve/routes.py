"""The route table of `grpo serve`: which endpoint answers a (method, path), who may call it,
and the operation name fault injection knows it by.

The OpenAI-compatible ``/v1/`` routes (`grpo.serve.openai_endpoints`) take the same API key
as the Control API (``Authorization: Bearer KEY``, what the ``openai`` client sends).

Auth kinds: ``control`` (the API key, when the server has one), ``actor`` (a token that a
run's creation handed out), ``files`` (the download token in the URL), ``none`` (only
``/``, the reachability probe).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

from grpo.serve import endpoints, openai_endpoints, tinker_rest
from grpo.serve import tinker_routes as tinker
from grpo.serve.events import EVENT_OPERATIONS, event_operation
from grpo.serve.messages import Reply, Request

AUTH_KINDS = ("control", "actor", "files", "none")
SUBMIT = "submit"  # the event submit: faults match the submitted event's own operation


@attrs.frozen
class Route:
    """One endpoint: `method` and `path` (a regex; its groups are the handler's arguments),
    the `handler`, its `auth` kind and its fault-injection `operation` ("" = never faulted)."""

    method: str
    path: re.Pattern[str] = attrs.field(converter=re.compile)
    handler: Callable[..., Reply]
    auth: str = attrs.field(default="control", validator=attrs.validators.in_(AUTH_KINDS))
    operation: str = ""

    def match(self, request: Request) -> tuple[str, ...] | None:
        """The path's ids when this route answers `request`, else None."""
        found = self.path.fullmatch(request.path)
        if found is None or self.method != request.method:
            return None
        return found.groups()

    def fault_operation(self, request: Request) -> str:
        """The operation faults are matched against for `request` ("" for none)."""
        return event_operation(request.body) if self.operation == SUBMIT else self.operation


_API, _ACTOR, _ID = "/api/openapi/v1", "/actor/v1", r"([^/]+)"

ROUTES: tuple[Route, ...] = (
    Route("GET", "/", endpoints.probe, auth="none"),
    Route("HEAD", "/", endpoints.probe_head, auth="none"),
    Route("POST", "/api/telemetry/event", endpoints.drop_telemetry),
    Route("GET", f"{_API}/api-key/verify", endpoints.verify_api_key, operation="verify_api_key"),
    Route("GET", "/api/sdk/bootstrap", endpoints.sdk_bootstrap, operation="sdk_bootstrap"),
    Route("GET", "/api/models", endpoints.list_models, operation="list_models"),
    Route(
        "POST",
        f"{_API}/service-sessions",
        endpoints.create_session,
        operation="create_service_session",
    ),
    Route(
        "GET",
        f"{_API}/service-sessions",
        endpoints.list_sessions,
        operation="list_service_sessions",
    ),
    Route(
        "GET",
        f"{_API}/service-sessions/{_ID}",
        endpoints.get_session,
        operation="get_service_session",
    ),
    Route(
        "POST",
        f"{_API}/service-sessions/{_ID}/renew",
        endpoints.renew_session,
        operation="renew_service_session",
    ),
    Route(
        "POST",
        f"{_API}/service-sessions/{_ID}/close",
        endpoints.close_session,
        operation="close_service_session",
    ),
    Route(
        "POST",
        f"{_API}/service-sessions/{_ID}/training-runs",
        endpoints.create_training_run,
        operation="create_training_run",
    ),
    Route(
        "PATCH",
        f"{_API}/service-sessions/{_ID}/training-runs/{_ID}",
        endpoints.update_training_run,
        operation="update_training_run",
    ),
    Route(
        "POST",
        f"{_API}/service-sessions/{_ID}/sampling-runs",
        endpoints.create_sampling_run,
        operation="create_sampling_run",
    ),
    Route(
        "GET",
        f"{_API}/training-runs/by-checkpoint-uri",
        endpoints.find_by_checkpoint,
        operation="find_training_run_by_checkpoint_uri",
    ),
    Route(
        "GET", f"{_API}/training-runs", endpoints.list_training_runs, operation="list_training_runs"
    ),
    Route(
        "GET",
        f"{_API}/training-runs/{_ID}",
        endpoints.get_training_run,
        operation="get_training_run",
    ),
    Route(
        "GET",
        f"{_API}/training-runs/{_ID}/checkpoints",
        endpoints.list_run_checkpoints,
        operation="list_training_run_checkpoints",
    ),
    Route(
        "POST",
        f"{_API}/training-runs/{_ID}/renew",
        endpoints.renew_training_run,
        operation="renew_training_run",
    ),
    Route(
        "GET",
        f"{_API}/sampling-runs/{_ID}",
        endpoints.get_sampling_run,
        operation="get_sampling_run",
    ),
    Route(
        "POST",
        f"{_API}/sampling-runs/{_ID}/renew",
        endpoints.renew_sampling_run,
        operation="renew_sampling_run",
    ),
    Route("GET", f"{_API}/checkpoints", endpoints.list_checkpoints, operation="list_checkpoints"),
    Route(
        "GET",
        f"{_API}/checkpoints/{_ID}/download-url",
        endpoints.download_url,
        operation="get_checkpoint_download_url",
    ),
    Route(  # pytrio 0.2.0-0.2.3's RestClient.get_checkpoint_archive_url: the same answer
        "GET",
        f"{_API}/checkpoints/{_ID}/archive",
        endpoints.download_url,
        operation="get_checkpoint_download_url",
    ),
    Route(
        "DELETE",
        f"{_API}/checkpoints/{_ID}",
        endpoints.delete_checkpoint,
        operation="delete_checkpoint",
    ),
    Route("POST", f"{_ACTOR}/events", endpoints.submit_event, auth="actor", operation=SUBMIT),
    Route(
        "GET", f"{_ACTOR}/events/{_ID}", endpoints.get_event, auth="actor", operation="get_event"
    ),
    Route(
        "POST",
        f"{_ACTOR}/client/heartbeat",
        endpoints.heartbeat,
        auth="actor",
        operation="heartbeat",
    ),
    Route(
        "POST",
        f"{_ACTOR}/sampling-runs/{_ID}/sample",
        endpoints.sample_request,
        auth="actor",
        operation="sample",
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        openai_endpoints.chat_completions,
        operation="chat_completions",
    ),
    Route("POST", "/v1/completions", openai_endpoints.completions, operation="completions"),
    Route("GET", "/v1/models", openai_endpoints.list_models, operation="list_openai_models"),
    *(  # Tinker's protocol (the official `tinker` SDK), grpo.serve.tinker_routes
        Route(method, f"/api/v1/{path}", handler, operation=f"tinker_{name}")
        for method, path, handler, name in (
            ("POST", "client/config", tinker.client_config, "client_config"),
            ("POST", "client/dynamic_config", tinker.client_dynamic_config, "client_config"),
            ("GET", "healthz", tinker.health, "healthz"),
            ("POST", "telemetry", tinker.telemetry, "telemetry"),
            ("POST", "create_session", tinker.create_session, "create_session"),
            ("POST", "session_heartbeat", tinker.session_heartbeat, "session_heartbeat"),
            ("POST", f"sessions/{_ID}/finish", tinker.finish_session, "finish_session"),
            ("GET", "get_server_capabilities", tinker.server_capabilities, "capabilities"),
            ("POST", "create_model", tinker.create_model, "create_model"),
            ("POST", "get_info", tinker.get_info, "get_info"),
            ("POST", "forward_backward", tinker.forward_backward, "forward_backward"),
            ("POST", "optim_step", tinker.optim_step, "optim_step"),
            ("POST", "save_weights", tinker.save_weights, "save_weights"),
            ("POST", "save_weights_for_sampler", tinker.save_weights_for_sampler, "save_sampler"),
            ("POST", "load_weights", tinker.load_weights, "load_weights"),
            ("POST", "create_sampling_session", tinker.create_sampling_session, "sampler"),
            ("GET", f"samplers/{_ID}", tinker.get_sampler, "get_sampler"),
            ("POST", "asample", tinker.asample, "asample"),
            ("POST", "retrieve_future", tinker.retrieve_future, "retrieve_future"),
            # the RestClient over the local store (grpo.serve.tinker_rest)
            ("GET", "training_runs", tinker_rest.list_training_runs, "list_training_runs"),
            ("GET", f"training_runs/{_ID}", tinker_rest.get_training_run, "get_training_run"),
            (
                "GET",
                f"training_runs/{_ID}/checkpoints",
                tinker_rest.list_checkpoints,
                "list_checkpoints",
            ),
            ("GET", "checkpoints", tinker_rest.list_user_checkpoints, "list_user_checkpoints"),
            ("POST", "weights_info", tinker_rest.weights_info, "weights_info"),
            ("GET", "sessions", tinker_rest.list_sessions, "list_sessions"),
            ("GET", f"sessions/{_ID}", tinker_rest.get_session, "get_session"),
            *(  # what cannot exist offline: a 400 naming it (before the generic delete)
                (method, path, tinker_rest.refusal(what, why), "not_served")
                for method, path, what, why in tinker_rest.REFUSALS
            ),
            (
                "DELETE",
                f"training_runs/{_ID}/checkpoints/(.+)",
                tinker_rest.delete_checkpoint,
                "delete_checkpoint",
            ),
        )
    ),
    Route(
        "GET",
        r"/files/checkpoints/([^/]+)\.tar",
        endpoints.download_checkpoint,
        auth="files",
        operation="download_checkpoint",
    ),
)
"""Every endpoint, in the order requests are matched."""

OPERATIONS = sorted(
    {route.operation for route in ROUTES if route.operation} - {SUBMIT}
    | set(EVENT_OPERATIONS.values()) - {"end_run"}
)
"""The operation names ``--fault`` accepts (``grpo serve --help`` lists them)."""
