"""The Tinker SDK's `RestClient` against `grpo serve`: training runs, checkpoints, weights
info and sessions over the local store; what cannot exist offline refused as a 400 naming it.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from grpo.backends.names import TINY_MODEL_NAME  # noqa: E402
from grpo.serve.server import ServeHandle, serve_in_thread  # noqa: E402
from tests.serve.conftest import SERVE_API_KEY  # noqa: E402
from tests.serve.test_tinker_sdk import (  # noqa: E402
    TINKER_KEY,
    TOKENS,
    ce_datum,
    close_clients,
    service,
)

RANK = 4


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeHandle]:
    """`grpo serve` on a free loopback port with an API key."""
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        yield handle
        close_clients()


def raw(handle: ServeHandle, method: str, path: str) -> tuple[int, dict[str, Any]]:
    """A raw request with the path sent as is (no client-side normalization)."""
    parts = urlsplit(handle.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(method, path, headers={"X-API-Key": TINKER_KEY})
        response = connection.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else {}
    finally:
        connection.close()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes
def test_rest_client_lists_gets_and_deletes_over_the_local_store(server: ServeHandle) -> None:
    client = service(server)
    session = client.holder.get_session_id()
    trainer = client.create_lora_training_client(
        base_model=TINY_MODEL_NAME,
        rank=RANK,
        seed=1,
        train_unembed=False,
        user_metadata={"renderer_name": "qwen3"},
    ).result()
    model_id = trainer.get_info().model_id
    trainer.forward_backward([ce_datum(TOKENS, np.ones(7))], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state_path = trainer.save_state("state-1").result().path
    sampler_path = trainer.save_weights_for_sampler("sampler-1").result().path
    client.create_sampling_client(model_path=sampler_path).result()
    idle = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=8).result()
    idle_id = idle.get_info().model_id
    rest = client.create_rest_client()

    runs = rest.list_training_runs().result()
    by_id = {run.training_run_id: run for run in runs.training_runs}
    assert set(by_id) == {model_id, idle_id} and runs.cursor.total_count == 2
    run = by_id[model_id]
    assert (run.base_model, run.lora_rank, run.is_lora) == (TINY_MODEL_NAME, RANK, True)
    assert run.last_checkpoint.tinker_path == state_path
    assert run.last_sampler_checkpoint.tinker_path == sampler_path
    assert by_id[idle_id].lora_rank == 8 and by_id[idle_id].last_checkpoint is None
    # user_metadata is kept in the store (tinker-cookbook reads its renderer back from it).
    assert run.user_metadata == {"renderer_name": "qwen3"}
    assert by_id[idle_id].user_metadata is None
    assert rest.get_training_run(model_id).result() == run
    assert rest.get_training_run_by_tinker_path(state_path).result() == run
    assert rest.get_training_run(idle_id).result().training_run_id == idle_id
    assert [
        r.training_run_id for r in rest.list_training_runs(limit=1, offset=1).result().training_runs
    ] == [runs.training_runs[1].training_run_id]

    listed = rest.list_checkpoints(model_id).result().checkpoints
    assert {(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in listed} == {
        ("training", "weights/state-1", state_path),
        ("sampler", "sampler_weights/sampler-1", sampler_path),
    }
    assert all(c.size_bytes and c.size_bytes > 0 and not c.public for c in listed)
    everything = rest.list_user_checkpoints().result()
    assert everything.cursor.total_count == 2 and len(everything.checkpoints) == 2
    assert len(rest.list_user_checkpoints(limit=1).result().checkpoints) == 1

    info = rest.get_weights_info_by_tinker_path(state_path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (TINY_MODEL_NAME, True, RANK)
    assert (info.train_unembed, info.train_mlp, info.train_attn) == (False, True, True)

    members = rest.get_session(session).result()
    assert set(members.training_run_ids) == {model_id, idle_id}
    assert len(members.sampler_ids) == 1
    assert rest.get_sampler(members.sampler_ids[0]).result().model_path == sampler_path
    assert session in rest.list_sessions().result().sessions

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    store = Path(server.state.registry.root) / model_id
    assert not (store / "sampler_weights" / "sampler-1").exists()
    assert (store / "weights" / "state-1").is_dir()
    assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [
        state_path
    ]
    with pytest.raises(tinker.NotFoundError, match="sampler-1"):
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError, match="training_run_id"):
        rest.get_training_run("no-such-run").result()
    with pytest.raises(tinker.BadRequestError):  # the sampler weights are gone
        client.create_sampling_client(model_path=sampler_path).result()
    # The state survives and still loads.
    assert client.create_training_client_from_state(state_path).result().get_info().lora_rank == 4


REFUSED: dict[str, Callable[[Any, str], Any]] = {
    "publish_checkpoint": lambda rest, path: rest.publish_checkpoint_from_tinker_path(path),
    "unpublish_checkpoint": lambda rest, path: rest.unpublish_checkpoint_from_tinker_path(path),
    "set_checkpoint_ttl": lambda rest, path: rest.set_checkpoint_ttl_from_tinker_path(path, 60),
    "external_weights_urls": lambda rest, path: rest.get_external_weights_urls(
        path.replace("/weights/", "/external_weights/")
    ),
    "copy_weights": lambda rest, path: rest.copy_weights(path, destination_project_id="p"),
    "project_id": lambda rest, path: rest.list_training_runs(project_id="p"),
    "assign_session_project": lambda rest, path: rest.assign_session_project("s", "p"),
    "export_session_trace": lambda rest, path: rest.export_session_trace("s"),
    "search_sessions": lambda rest, path: rest.search_sessions(
        types.SessionSearchRequest(session_id="x")
    ),
    "get_audit_log": lambda rest, path: rest.get_audit_log(),
    "get_billing_usage": lambda rest, path: rest.get_billing_usage("2026-01-01", "2026-02-01"),
    "get_current_checkpoint_storage_usage": lambda rest, path: (
        rest.get_current_checkpoint_storage_usage()
    ),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_what_cannot_exist_offline_is_a_400_naming_it_and_the_server_serves_on(
    server: ServeHandle,
) -> None:
    client = service(server)
    trainer = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=8).result()
    state_path = trainer.save_state("kept").result().path
    rest = client.create_rest_client()
    for name, call in REFUSED.items():
        with pytest.raises(tinker.BadRequestError, match=f"{name}.*not served"):
            call(rest, state_path).result()
        assert rest.list_checkpoints(trainer.get_info().model_id).result().checkpoints
    with pytest.raises(tinker.BadRequestError, match="user_metadata"):
        client.create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=4, user_metadata={"k": ["not", "a", "string"]}
        ).result()
    for method, path in (
        ("POST", "/api/v1/auth/token"),
        ("POST", "/api/v1/create_custom_loss"),
        ("POST", "/api/v1/join_sampling_session"),
        ("POST", "/api/v1/save_weights_external"),
    ):
        status, body = raw(server, method, path)
        assert status == 400 and "not served" in body["message"], (path, body)


def test_checkpoint_paths_cannot_leave_the_store(server: ServeHandle, tmp_path: Path) -> None:
    root = Path(server.state.registry.root)
    outside = root.parent / "weights" / "victim"
    outside.mkdir(parents=True)
    (outside / "grpo_local.json").write_text("{}")
    for path in (
        "/api/v1/training_runs/../checkpoints/weights/victim",
        "/api/v1/training_runs/%2E%2E/checkpoints/weights/victim",
        "/api/v1/training_runs/run/checkpoints/weights/..",
        "/api/v1/training_runs/run/checkpoints/external_weights/x",
    ):
        status, body = raw(server, "DELETE", path)
        assert 400 <= status < 500, (path, status, body)
    assert (outside / "grpo_local.json").is_file()
    rest = service(server).create_rest_client()
    with pytest.raises(tinker.BadRequestError, match="tinker_path"):
        rest.get_weights_info_by_tinker_path("tinker://../weights/victim").result()
