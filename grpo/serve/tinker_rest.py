"""The Tinker SDK's `RestClient` endpoints in `grpo serve`, over the local store.

Training runs and checkpoints are read from the store on disk (the local backend's RestClient
over the server's root), so they cover earlier processes' saves and PyTRIO runs' too; a training
client of this process that has saved nothing yet is a training run as well. A checkpoint's
Tinker id is ``weights/NAME`` or ``sampler_weights/NAME`` and its path
``tinker://RUN/weights/NAME``, one to one with ``<root>/RUN/weights/NAME``. Sessions are this
process's Tinker sessions.

What cannot exist offline (publishing, TTLs, external weights and their URLs, copies from
another account, projects, trace exports, session search, audit logs, billing, JWT tokens,
server-side custom losses, joined sampling sessions) is a 400 naming what is not served and
why: never a 5xx, which the SDK retries without limit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytrio.errors.base import PyTrioError

from grpo.backends.local import checkpoint_lora_spec, read_checkpoint_metadata, resolve_checkpoint
from grpo.serve.limits import MAX_FIELD_CHARS
from grpo.serve.messages import Reply, Request
from grpo.serve.tinker_wire import local_uri
from grpo.serve.wire import ServeError, local_call, not_found

_SCOPES = ("owned", "accessible")
RUN_FILE = "tinker_run.json"
"""Beside a Tinker training run's checkpoints: the ``user_metadata`` its client was made with."""
MAX_METADATA_KEYS = 64


def user_metadata(body: dict[str, Any]) -> dict[str, str] | None:
    """The body's ``user_metadata`` (string keys and values, bounded); 400 naming it."""
    value = body.get("user_metadata")
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_KEYS
        or not all(
            isinstance(item, str) and len(item) <= MAX_FIELD_CHARS
            for pair in value.items()
            for item in pair
        )
    ):
        raise ServeError(
            400,
            "validation.invalid_request",
            f"user_metadata must be an object of at most {MAX_METADATA_KEYS} string keys and "
            f"values, each at most {MAX_FIELD_CHARS} characters",
        )
    return value


def write_run_metadata(
    root: Path, run_id: str, base_model: str, metadata: dict[str, str] | None
) -> None:
    """Keep a training run's base model as its client named it (an alias too) and its
    ``user_metadata`` in the store (tinker-cookbook keeps its renderer there and reads it back
    when it loads a checkpoint)."""
    directory = root / run_id
    directory.mkdir(parents=True, exist_ok=True)
    record = {"base_model": base_model, "user_metadata": metadata}
    (directory / RUN_FILE).write_text(json.dumps(record))


def run_record(root: Path, run_id: str) -> dict[str, Any]:
    """A stored run's ``base_model`` (as asked) and ``user_metadata``, each None when the
    store holds none (a PyTRIO run, an older store, an unreadable file)."""
    try:
        found = json.loads((root / run_id / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        found = {}
    found = found if isinstance(found, dict) else {}
    base, metadata = found.get("base_model"), found.get("user_metadata")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        metadata = None
    return {"base_model": base if isinstance(base, str) else None, "user_metadata": metadata}


def _rest(state: Any) -> Any:
    """The local backend's RestClient over the server's root (the local store)."""
    return state.registry.local.create_rest_client()


def _checkpoint(record: Any) -> dict[str, Any]:
    """Tinker's `Checkpoint` of a local one (id ``RUN/weights/NAME``)."""
    run, kind, name = record.checkpoint_id.split("/", 2)
    return {
        "checkpoint_id": f"{kind}/{name}",
        "checkpoint_type": record.checkpoint_type,
        "time": record.time.isoformat(),
        "tinker_path": f"tinker://{run}/{kind}/{name}",
        "size_bytes": record.size_bytes,
        "public": False,
        "expires_at": None,  # local checkpoints never expire
    }


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    return request.int_param("limit", default_limit), request.int_param("offset", 0)


def _scope(request: Request) -> None:
    """400 unless the query's access_scope is Tinker's: both mean the whole local store."""
    scope = request.query.get("access_scope", "owned")
    if scope not in _SCOPES:
        raise ServeError(
            400,
            "validation.invalid_request",
            f"query access_scope must be one of {', '.join(_SCOPES)}, got {scope!r:.40}",
        )


def _runs(state: Any) -> list[dict[str, Any]]:
    """Every training run: the store's, then this process's training clients not in it."""
    runs = []
    stored_runs = local_call(lambda: _rest(state).list_training_runs(limit=10**9).result())
    for run in stored_runs.training_runs:
        record = run_record(state.registry.root, run.training_run_id)
        runs.append(
            {
                "training_run_id": run.training_run_id,
                "base_model": record["base_model"] or run.base_model,
                "model_owner": run.model_owner,
                "is_lora": True,
                "lora_rank": run.lora_rank,
                "last_request_time": run.last_request_time.isoformat(),
                "last_checkpoint": run.last_checkpoint and _checkpoint(run.last_checkpoint),
                "last_sampler_checkpoint": run.last_sampler_checkpoint
                and _checkpoint(run.last_sampler_checkpoint),
                "user_metadata": record["user_metadata"],
            }
        )
    stored = {run["training_run_id"] for run in runs}
    for model in state.tinker.live_models():
        if model.model_id not in stored:
            runs.append(
                {
                    "training_run_id": model.model_id,
                    "base_model": model.base_model,
                    "model_owner": "local",
                    "is_lora": True,
                    "lora_rank": model.rank,
                    "last_request_time": datetime.fromtimestamp(
                        model.created_unix, UTC
                    ).isoformat(),
                }
            )
    return runs


def list_training_runs(state: Any, request: Request) -> Reply:
    """`TrainingRunsResponse`: a page of the training runs, least recently saved first."""
    _scope(request)
    if request.query.get("project_id") is not None:
        raise ServeError(
            400,
            "validation.not_served",
            "query project_id is not served: grpo serve has no projects (one local store); "
            "list without project_id",
        )
    limit, offset = _page(request, 20)
    runs = _runs(state)
    cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
    return Reply(200, {"training_runs": runs[offset : offset + limit], "cursor": cursor})


def get_training_run(state: Any, request: Request, run_id: str) -> Reply:
    """`TrainingRun` of one run; 404 naming it when the store and this process hold none."""
    _scope(request)
    for run in _runs(state):
        if run["training_run_id"] == run_id:
            return Reply(200, run)
    raise not_found("training_run_id", run_id)


def list_checkpoints(state: Any, request: Request, run_id: str) -> Reply:
    """`CheckpointsListResponse` of one run, oldest first (unpaginated, as Tinker's)."""
    found = local_call(lambda: _rest(state).list_checkpoints(run_id).result())
    return Reply(200, {"checkpoints": [_checkpoint(item) for item in found.checkpoints]})


def list_user_checkpoints(state: Any, request: Request) -> Reply:
    """`CheckpointsListResponse`: a page of every checkpoint in the store, oldest first."""
    limit, offset = _page(request, 100)
    found = local_call(lambda: _rest(state).list_user_checkpoints(limit, offset).result())
    cursor = found.cursor
    return Reply(
        200,
        {
            "checkpoints": [_checkpoint(item) for item in found.checkpoints],
            "cursor": {"offset": offset, "limit": limit, "total_count": cursor.total_count},
        },
    )


def delete_checkpoint(state: Any, request: Request, run_id: str, checkpoint_id: str) -> Reply:
    """Delete ``tinker://RUN/CHECKPOINT_ID`` from the store; 404 when it is none."""
    path = f"tinker://{run_id}/{checkpoint_id}"
    uri = local_uri(path, state.registry.root, "checkpoint_id")  # 400 for any other form
    try:
        _rest(state).delete_checkpoint(run_id, f"{run_id}/{checkpoint_id}")
    except PyTrioError:  # no checkpoint there
        raise not_found("checkpoint", path) from None
    state.registry.forget_checkpoint(uri)
    return Reply(200)


def weights_info(state: Any, request: Request) -> Reply:
    """`WeightsInfoResponse` of a ``tinker://`` checkpoint: its base model and LoRA layout."""
    path = request.json().get("tinker_path")
    if not isinstance(path, str):
        raise ServeError(400, "validation.invalid_request", "tinker_path must be a string")
    uri = local_uri(path, state.registry.root, "tinker_path")
    metadata = local_call(lambda: read_checkpoint_metadata(resolve_checkpoint(uri)))
    spec = checkpoint_lora_spec(metadata)
    asked = run_record(state.registry.root, path.removeprefix("tinker://").split("/")[0])
    return Reply(
        200,
        {
            "base_model": asked["base_model"] or str(metadata["base_model"]),
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": spec.rank,
            "train_unembed": spec.train_unembed,
            "train_mlp": spec.train_mlp,
            "train_attn": spec.train_attn,
        },
    )


def get_session(state: Any, request: Request, session_id: str) -> Reply:
    """`GetSessionResponse`: the session's training clients and sampling sessions."""
    models, samplers = state.tinker.session_members(session_id)
    return Reply(200, {"training_run_ids": models, "sampler_ids": samplers})


def list_sessions(state: Any, request: Request) -> Reply:
    """`ListSessionsResponse`: a page of this process's sessions, oldest first."""
    limit, offset = _page(request, 20)
    return Reply(200, {"sessions": state.tinker.session_ids()[offset : offset + limit]})


def refusal(what: str, why: str) -> Callable[..., Reply]:
    """An endpoint that answers 400 naming `what` is not served and `why`."""

    def refuse(state: Any, request: Request, *ids: str) -> Reply:
        raise ServeError(400, "validation.not_served", f"{what} is not served: {why}")

    refuse.__doc__ = f"400: {what} is not served offline."
    return refuse


_OFFLINE = "grpo serve is one offline machine"
REFUSALS: tuple[tuple[str, str, str, str], ...] = (
    # (method, path under /api/v1/, what, why)
    (
        "POST",
        "copy_weights",
        "copy_weights",
        f"{_OFFLINE}; load a checkpoint by its tinker:// path",
    ),
    (
        "POST",
        "save_weights_external",
        "save_weights_external",
        f"{_OFFLINE} without external storage; save_state / save_weights_for_sampler write to "
        "the local store",
    ),
    (
        "GET",
        r"training_runs/([^/]+)/checkpoints/(.+)/external_weights_urls",
        "external_weights_urls",
        f"{_OFFLINE} without external storage; its checkpoints are files under the server's root",
    ),
    (
        "POST",
        r"training_runs/([^/]+)/checkpoints/(.+)/publish",
        "publish_checkpoint",
        f"{_OFFLINE} with no other users; copy the checkpoint's files to share them",
    ),
    (
        "DELETE",
        r"training_runs/([^/]+)/checkpoints/(.+)/publish",
        "unpublish_checkpoint",
        f"{_OFFLINE} with no other users, so nothing is published",
    ),
    (
        "PUT",
        r"training_runs/([^/]+)/checkpoints/(.+)/ttl",
        "set_checkpoint_ttl",
        "local checkpoints never expire; delete one with delete_checkpoint",
    ),
    ("PUT", r"sessions/([^/]+)/project", "assign_session_project", "grpo serve has no projects"),
    (
        "GET",
        r"sessions/([^/]+)/trace_export",
        "export_session_trace",
        "grpo serve keeps no request traces",
    ),
    ("POST", "sessions/search", "search_sessions", "use list_sessions and get_session"),
    ("GET", "audit", "get_audit_log", f"{_OFFLINE}; it keeps no audit log"),
    ("GET", r"billing/usage/events", "get_billing_usage", f"{_OFFLINE}; nothing is billed"),
    (
        "GET",
        r"billing/usage/checkpoints/current",
        "get_current_checkpoint_storage_usage",
        f"{_OFFLINE}; nothing is billed (list_user_checkpoints gives each checkpoint's size)",
    ),
    (
        "POST",
        r"auth/token",
        "auth/token (JWT)",
        "the SDK keeps its plain API key (X-API-Key), as client/config tells it",
    ),
    (
        "POST",
        "create_custom_loss",
        "create_custom_loss",
        "custom losses run client-side through forward_backward_custom",
    ),
    (
        "POST",
        "join_sampling_session",
        "join_sampling_session",
        "make a sampling client with create_sampling_client",
    ),
)
"""The RestClient (and service) endpoints that cannot exist offline, refused by name."""
