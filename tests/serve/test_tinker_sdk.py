"""`grpo serve`'s Tinker route through the official `tinker` SDK (0.38.0), unchanged.

Every method the SDK's core training loop calls; an rl_loop-shaped job whose per-step losses
equal the same steps in-process on the local backend under Tinker's sum semantics; refused
requests (4xx naming the field, the server serving the next request); seq_id order and
idempotent retries over raw HTTP.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from grpo.backends.local import LocalServiceClient  # noqa: E402
from grpo.backends.names import TINY_MODEL_NAME  # noqa: E402
from grpo.serve.server import ServeHandle, serve_in_thread  # noqa: E402
from grpo.serve.tinker_routes import tinker_exports  # noqa: E402
from tests.serve.conftest import SERVE_API_KEY  # noqa: E402

TINKER_KEY = f"tml-{SERVE_API_KEY}"
TOKENS = [5, 17, 42, 9, 77, 12, 31, 8]
LOSS_TOLERANCE = 1e-4  # relative, float32 sums of a few dozen terms
RANK = 4


_OPEN_CLIENTS: list[Any] = []  # the SDK clients `service` made, closed by `close_clients`


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServeHandle]:
    """`grpo serve` on a free loopback port with an API key; the SDK's telemetry left on."""
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        yield handle
        close_clients()


def service(handle: ServeHandle) -> Any:
    """The SDK's ServiceClient on `handle`, with the key in the form the SDK accepts (its
    session finished by `close_clients`, if not before)."""
    client = tinker.ServiceClient(base_url=handle.url, api_key=TINKER_KEY)
    _OPEN_CLIENTS.append(client)
    return client


def close_clients() -> None:
    """Finish the sessions of the SDK clients `service` made (while their server still runs:
    else each would heartbeat a gone server for the rest of the session)."""
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close("success").result(timeout=30)


def policy_datum(tokens: list[int], advantage: float, logprobs: np.ndarray) -> Any:
    """An importance_sampling datum: next-token targets, sampling log-probs, one advantage."""
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": np.asarray(logprobs, dtype=np.float32),
            "advantages": np.full(n, advantage, dtype=np.float32),
        },
    )


def ce_datum(tokens: list[int], weights: Any) -> Any:
    """A cross_entropy datum with per-token `weights` (an array, or a TensorData)."""
    weights = (
        weights if isinstance(weights, types.TensorData) else np.asarray(weights, dtype=np.float32)
    )
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": weights,
        },
    )


def post(handle: ServeHandle, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A raw JSON POST to the Tinker route: (status, body)."""
    request = urllib.request.Request(
        f"{handle.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-API-Key": TINKER_KEY},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes
def test_the_sdk_drives_every_method(server: ServeHandle) -> None:
    client = service(server)
    capabilities = client.get_server_capabilities()
    assert TINY_MODEL_NAME in [model.model_name for model in capabilities.supported_models]
    health = urllib.request.Request(
        f"{server.url}/api/v1/healthz", headers={"X-API-Key": TINKER_KEY}
    )
    with urllib.request.urlopen(health, timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    assert post(server, "/api/v1/telemetry", {"events": []}) == (200, {"status": "accepted"})

    trainer = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK, seed=3)
    trainer = trainer.result()
    info = trainer.get_info()
    session = client.holder.get_session_id()
    assert info.model_id == f"{session}:train:0"  # the form the SDK computes itself
    assert (info.lora_rank, info.model_data.tokenizer_id) == (RANK, TINY_MODEL_NAME)

    # Dense and sparse (CSR) tensors decode to the same datum.
    weights = np.array([0, 0, 1, 1, 0, 2, 1], dtype=np.float32)
    columns = np.flatnonzero(weights)
    sparse = types.TensorData(
        data=weights[columns].tolist(),
        dtype="float32",
        shape=[len(weights)],
        sparse_crow_indices=[0, len(columns)],
        sparse_col_indices=columns.tolist(),
    )
    dense_out = trainer.forward([ce_datum(TOKENS, weights)], "cross_entropy").result()
    sparse_out = trainer.forward([ce_datum(TOKENS, sparse)], "cross_entropy").result()
    forward_logprobs = dense_out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert set(dense_out.metrics) == {"loss:sum"}
    assert dense_out.metrics["loss:sum"] == pytest.approx(sparse_out.metrics["loss:sum"])
    # A built-in loss is a sum over tokens, no divisor: cross_entropy = -sum(w * logprob).
    expected = -float(np.sum(weights * forward_logprobs))
    assert dense_out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    out = trainer.forward_backward(
        [policy_datum(TOKENS, 1.0, forward_logprobs)], "importance_sampling"
    ).result()
    assert out.metrics["loss:sum"] == pytest.approx(-len(forward_logprobs), rel=1e-4)
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm"] > 0

    # Saves map one to one onto the local store.
    sampler_path = trainer.save_weights_for_sampler("sampler-1").result().path
    state_path = trainer.save_state("state-1").result().path
    assert sampler_path == f"tinker://{info.model_id}/sampler_weights/sampler-1"
    assert state_path == f"tinker://{info.model_id}/weights/state-1"
    store = Path(server.state.registry.root) / info.model_id
    assert (store / "sampler_weights" / "sampler-1").is_dir()
    assert (store / "weights" / "state-1").is_dir()

    # Sampling: the unnamed save, named sampler weights, and prompt log-probs.
    live = trainer.save_weights_and_get_sampling_client().result()
    saved = client.create_sampling_client(model_path=sampler_path).result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    first = live.sample(prompt, 2, params).result()
    second = saved.sample(prompt, 2, params).result()
    assert len(first.sequences) == 2
    assert [s.tokens for s in first.sequences] == [s.tokens for s in second.sequences]
    assert all(s.sequence_id for s in first.sequences)
    scored = saved.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert scored[0] is None and len(scored) == len(TOKENS)
    after = trainer.forward([ce_datum(TOKENS, np.ones(7))], "cross_entropy").result()
    np.testing.assert_allclose(
        scored[1:], after.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-4, atol=1e-5
    )

    # Training clients from a state, with and without the optimizer, in the SDK's own form.
    restored = client.create_training_client_from_state_with_optimizer(state_path).result()
    assert restored.get_info().model_id == f"{session}:train:1"
    plain = client.create_training_client_from_state(state_path).result()
    again = restored.forward([ce_datum(TOKENS, np.ones(7))], "cross_entropy").result()
    assert again.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"], rel=1e-5)
    assert plain.optim_step(types.AdamParams()).result().metrics["optimizer_step"] == 1.0
    assert restored.optim_step(types.AdamParams()).result().metrics["optimizer_step"] == 2.0
    fresh = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK).result()
    fresh.load_state(state_path).result()
    loaded = fresh.forward([ce_datum(TOKENS, np.ones(7))], "cross_entropy").result()
    assert loaded.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"], rel=1e-5)

    client.close("success").result()
    status, body = post(server, "/api/v1/session_heartbeat", {"session_id": session})
    # 410: the status on which the SDK's heartbeat loop stops ("session has finished")
    assert status == 410 and "finished" in body["message"]


def test_stop_token_is_kept_in_sampled_tokens(server: ServeHandle) -> None:
    sampler = service(server).create_sampling_client(base_model=TINY_MODEL_NAME).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    prompt = types.ModelInput.from_ints(TOKENS)
    free = sampler.sample(prompt, 1, greedy).result().sequences[0]
    stop_token = free.tokens[2]
    stopped = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_token])
    ).result()
    sequence = stopped.sequences[0]
    assert sequence.stop_reason == "stop"
    assert sequence.tokens == free.tokens[: free.tokens.index(stop_token) + 1]


def rl_steps(trainer: Any, sample: Any, steps: int) -> list[tuple[dict[str, float], float]]:
    """A few rl_loop-shaped steps: sample, score, importance_sampling, Adam; each step's
    forward_backward metrics and gradient norm (Adam is blind to a gradient's scale, the
    norm is not: it tells a summed loss from a divided one)."""
    losses = []
    for step in range(steps):
        prompt = TOKENS[: 3 + step]
        sequences = sample(prompt, step)
        data = []
        for index, (tokens, logprobs) in enumerate(sequences):
            full = prompt + tokens
            old = np.concatenate([np.zeros(len(prompt) - 1), logprobs]).astype(np.float32)
            data.append(policy_datum(full, 1.0 if index % 2 else -0.5, old))
        output = trainer.forward_backward(data, "importance_sampling").result()
        step_metrics = trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result().metrics
        losses.append((output.metrics, step_metrics["grad_norm"]))
    return losses


def test_rl_loop_losses_equal_the_in_process_steps(server: ServeHandle, tmp_path: Path) -> None:
    client = service(server)
    trainer = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK, seed=5)
    trainer = trainer.result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0)

    def sample_served(prompt: list[int], step: int) -> list[tuple[list[int], list[float]]]:
        sampler = trainer.save_weights_and_get_sampling_client().result()
        seeded = params.model_copy(update={"seed": step})
        response = sampler.sample(types.ModelInput.from_ints(prompt), 4, seeded).result()
        return [(s.tokens, s.logprobs) for s in response.sequences]

    served_steps = rl_steps(trainer, sample_served, 3)
    served = [metrics["loss:sum"] for metrics, _norm in served_steps]

    import pytrio

    with LocalServiceClient(root=tmp_path / "local", service_normalization="sum") as local:
        reference = local.create_lora_training_client(TINY_MODEL_NAME, rank=RANK, seed=5)

        def sample_local(prompt: list[int], step: int) -> list[tuple[list[int], list[float]]]:
            sampler = reference.save_weights_and_get_sampling_client()
            seeded = pytrio.SamplingParams(max_tokens=5, temperature=1.0, seed=step)
            response = sampler.sample(pytrio.ModelInput.from_ints(prompt), 4, seeded).result()
            return [(list(s.tokens), list(s.logprobs)) for s in response.sequences]

        class Reference:  # the local client in the SDK's call shapes
            def forward_backward(self, data: list[Any], loss_fn: str) -> Any:
                local_data = [
                    pytrio.Datum(
                        model_input=pytrio.ModelInput.from_ints(d.model_input.to_ints()),
                        loss_fn_inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
                    )
                    for d in data
                ]
                return reference.forward_backward(local_data, loss_fn)

            def optim_step(self, adam: Any) -> Any:
                return reference.optim_step(pytrio.AdamParams(**adam.model_dump()))

        local_steps = rl_steps(Reference(), sample_local, 3)
    assert len(set(served)) == 3  # the steps differ: the weights moved
    local_losses = [metrics["loss_sum"] for metrics, _norm in local_steps]
    np.testing.assert_allclose(served, local_losses, rtol=LOSS_TOLERANCE, atol=1e-6)
    np.testing.assert_allclose(
        [norm for _m, norm in served_steps],
        [norm for _m, norm in local_steps],
        rtol=LOSS_TOLERANCE,
    )


def test_refused_requests_are_4xx_naming_the_field_and_the_server_serves_on(
    server: ServeHandle,
) -> None:
    client = service(server)
    trainer = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK).result()
    datum = policy_datum(TOKENS, 1.0, np.zeros(7))
    started = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="loss_fn=importance_sampling"):
        trainer.forward_backward([datum], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="reduction"):
        trainer.forward_backward([datum], "ppo", {"reduction": 1.0}).result()
    with pytest.raises(tinker.BadRequestError, match="optimizer_config"):
        client.create_lora_training_client(
            base_model=TINY_MODEL_NAME, optimizer=types.DimuonOptimizerConfig()
        ).result()
    with pytest.raises(tinker.NotFoundError, match="base_model"):
        client.create_lora_training_client(base_model="no/such-model").result()
    # A computation that fails is a finished future of the user's category.
    bad = ce_datum(TOKENS, np.full(7, 1e38))  # finite; its loss overflows on the trainer
    with pytest.raises(tinker.RequestFailedError) as failed:
        trainer.forward_backward([bad], "cross_entropy").result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert time.monotonic() - started < 30  # refused at once, never retried
    # The same training client is served next, in order.
    out = trainer.forward_backward([datum], "importance_sampling").result()
    assert np.isfinite(out.metrics["loss:sum"])
    assert trainer.optim_step(types.AdamParams()).result().metrics["optimizer_step"] == 1.0


def test_seq_id_order_and_idempotent_retries(server: ServeHandle) -> None:
    status, session = post(server, "/api/v1/create_session", {"tags": [], "sdk_version": "x"})
    assert status == 200
    model = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": TINY_MODEL_NAME,
        "lora_config": {"rank": RANK, "seed": 0},
    }
    created = post(server, "/api/v1/create_model", model)[1]
    assert post(server, "/api/v1/create_model", model)[1] == created  # a retry: same model
    model_id = created["model_id"]

    def step(seq_id: int) -> dict[str, Any]:
        body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
        return post(server, "/api/v1/optim_step", body)[1]

    def result(future: dict[str, Any]) -> dict[str, Any]:
        return post(server, "/api/v1/retrieve_future", {"request_id": future["request_id"]})[1]

    later: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: later.update(step(2)))
    thread.start()  # seq 2 arrives first and waits for seq 1
    time.sleep(0.3)
    earlier = step(1)
    thread.join(timeout=30)
    assert result(earlier)["metrics"]["optimizer_step"] == 1.0
    assert result(later)["metrics"]["optimizer_step"] == 2.0
    assert step(2)["request_id"] == later["request_id"]  # a retried seq_id: the same future
    assert result(step(3))["metrics"]["optimizer_step"] == 3.0
    sampling = {"session_id": session["session_id"], "sampling_session_seq_id": 0}
    sampler = post(
        server, "/api/v1/create_sampling_session", {**sampling, "base_model": model["base_model"]}
    )[1]
    ask = {
        "sampling_session_id": sampler["sampling_session_id"],
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "sampling_params": {"max_tokens": 3},
    }
    first = post(server, "/api/v1/asample", ask)[1]
    assert post(server, "/api/v1/asample", ask)[1] == first  # a retried sample: same future
    assert post(server, "/api/v1/asample", {**ask, "seq_id": 1})[1] != first


def test_wrong_key_and_exports(server: ServeHandle, tmp_path: Path) -> None:
    request = urllib.request.Request(
        f"{server.url}/api/v1/client/config",
        data=b'{"sdk_version": "0.38.0"}',
        headers={"X-API-Key": "tml-wrong"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    assert "TINKER_API_KEY" in json.loads(refused.value.read())["message"]
    lines = tinker_exports(server.url, tmp_path / "hub", keyed=True)
    assert lines[0] == f"export TINKER_BASE_URL={server.url}"
    assert lines[1].startswith("export TINKER_API_KEY=tml-")
    assert lines[2] == f"export HF_HUB_CACHE={tmp_path / 'hub' / 'huggingface'}"
    assert lines[3] == "export HF_HUB_OFFLINE=1"


LOSS_CONFIGS = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_high_threshold": 2.0},
    "dro": {"beta": 0.2},
}


def test_every_tinker_loss_takes_the_kernel_registry_config(
    server: ServeHandle, tmp_path: Path
) -> None:
    import pytrio

    trainer = service(server).create_lora_training_client(
        base_model=TINY_MODEL_NAME, rank=RANK, seed=7
    )
    trainer = trainer.result()
    old = np.linspace(-3.0, -1.0, 7).astype(np.float32)
    datum = policy_datum(TOKENS, 0.7, old)
    datum.loss_fn_inputs["weights"] = types.TensorData.from_numpy(np.ones(7, np.float32))
    with LocalServiceClient(root=tmp_path / "local", service_normalization="sum") as local:
        reference = local.create_lora_training_client(TINY_MODEL_NAME, rank=RANK, seed=7)
        local_datum = pytrio.Datum(
            model_input=pytrio.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()},
        )
        for loss_fn, config in LOSS_CONFIGS.items():
            served = trainer.forward([datum], loss_fn, config).result().metrics["loss:sum"]
            local_loss = reference.forward([local_datum], loss_fn, config).result()
            assert served == pytest.approx(local_loss.metrics["loss_sum"], rel=1e-5), loss_fn
    with pytest.raises(tinker.BadRequestError, match="clip_mid"):
        trainer.forward([datum], "ppo", {"clip_mid": 1.0}).result()
    with pytest.raises(tinker.BadRequestError, match="importance_sampling, ppo, cispo, dro"):
        trainer.forward([datum], "gspo").result()


def test_a_custom_loss_runs_client_side_and_trains(server: ServeHandle) -> None:
    import torch

    trainer = service(server).create_lora_training_client(
        base_model=TINY_MODEL_NAME, rank=RANK, seed=2
    )
    trainer = trainer.result()
    datum = ce_datum(TOKENS, np.ones(7))

    def squared(data: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared": float(loss)}

    before = trainer.forward([datum], "cross_entropy").result()
    expected = float(np.sum(before.loss_fn_outputs[0]["logprobs"].to_numpy() ** 2))
    out = trainer.forward_backward_custom([datum], squared).result()
    assert out.metrics["squared"] == pytest.approx(expected, rel=1e-5)
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    after = trainer.forward([datum], "cross_entropy").result()
    lp_after = torch.tensor(after.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert float((lp_after**2).sum()) < expected  # the step lowered the custom loss


HOSTILE = (None, -1, 10**30, 1.5, True, "x" * 5000, "\x00", "../../etc", [["n"]], {"a": 1}, [-3])


def test_hostile_fields_on_every_tinker_body_are_4xx_naming_something(server: ServeHandle) -> None:
    session = post(server, "/api/v1/create_session", {"tags": [], "sdk_version": "x"})[1]
    sid = session["session_id"]
    model = {"session_id": sid, "model_seq_id": 0, "base_model": TINY_MODEL_NAME}
    model_id = post(server, "/api/v1/create_model", {**model, "lora_config": {"rank": 4}})[1][
        "model_id"
    ]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    bodies = {
        "create_model": {**model, "model_seq_id": 1, "lora_config": {"rank": 4, "seed": 1}},
        "optim_step": {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}},
        "save_weights": {"model_id": model_id, "path": "w", "seq_id": 2},
        "save_weights_for_sampler": {"model_id": model_id, "path": "s", "seq_id": 3},
        "load_weights": {"session_id": sid, "model_seq_id": 2, "path": "tinker://a/weights/b"},
        "create_sampling_session": {
            "session_id": sid,
            "sampling_session_seq_id": 0,
            "base_model": TINY_MODEL_NAME,
        },
        "asample": {
            "base_model": TINY_MODEL_NAME,
            "prompt": prompt,
            "num_samples": 1,
            "sampling_params": {"max_tokens": 2},
            "prompt_logprobs": False,
        },
        "retrieve_future": {"request_id": "nope"},
        "get_info": {"model_id": model_id},
        "session_heartbeat": {"session_id": sid},
    }
    failures, tried = [], 0
    for name, valid in bodies.items():
        cases = [{k: v for k, v in valid.items() if k != field} for field in valid]
        cases += [{**valid, field: value} for field in valid for value in HOSTILE]
        for body in cases:
            status, reply = post(server, f"/api/v1/{name}", body)
            tried += 1
            if status >= 500 or status == 409 or (status >= 400 and not reply.get("message")):
                failures.append((name, body, status, reply))
    garbage = urllib.request.Request(
        f"{server.url}/api/v1/forward_backward",
        data=bytes(range(256)),
        headers={"Content-Type": "application/x-protobuf", "X-API-Key": TINKER_KEY},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(garbage, timeout=10)
    assert refused.value.code == 400
    assert not failures, failures[:5]
    assert tried > 300
    # The server serves on: a good request after the sweep, through the SDK.
    sampler = service(server).create_sampling_client(base_model=TINY_MODEL_NAME).result()
    prompt_input = types.ModelInput.from_ints([1, 2, 3])
    sampled = sampler.sample(prompt_input, 1, types.SamplingParams(max_tokens=2)).result()
    assert len(sampled.sequences[0].tokens) == 2


def test_a_server_without_the_tinker_package_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from grpo.serve.tinker_wire import decode_forward_backward
    from grpo.serve.wire import ServeError

    monkeypatch.setitem(sys.modules, "tinker.proto", None)  # import fails as if absent
    with pytest.raises(ServeError) as refused:
        decode_forward_backward(b"")
    assert refused.value.status == 400
    assert "pip install 'grpo[tinker]'" in refused.value.message


def test_retrieve_future_long_polls_then_answers_try_again_while_running(
    server: ServeHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import Future

    from grpo.serve import tinker_routes
    from grpo.serve.tinker_service import Pending

    monkeypatch.setattr(tinker_routes, "MAX_LONG_POLL_S", 0.3)
    future: Future = Future()
    request_id = server.state.tinker.add_future(Pending(future))
    started = time.monotonic()
    status, body = post(server, "/api/v1/retrieve_future", {"request_id": request_id})
    assert time.monotonic() - started >= 0.3  # it waited before answering
    assert (status, body["type"], body["request_id"]) == (200, "try_again", request_id)
    threading.Timer(0.1, lambda: future.set_result({"metrics": {"x": 1.0}})).start()
    status, body = post(server, "/api/v1/retrieve_future", {"request_id": request_id})
    assert (status, body) == (200, {"metrics": {"x": 1.0}})  # answered as soon as it finished


def test_forward_backward_datums_decode_as_a_validated_construction_would() -> None:
    from pytrio.types import Datum, ModelInput
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from grpo.serve.tinker_wire import decode_forward_backward
    from grpo.serve.wire import ServeError

    sent = [
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[: 3 + index]),
            loss_fn_inputs={
                "target_tokens": np.arange(3 + index, dtype=np.int64),
                "weights": np.linspace(-1.5, 2.25, 3 + index, dtype=np.float32),
            },
        )
        for index in range(3)
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=sent, loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    message = forward_backward_request_to_proto(request)
    decoded = decode_forward_backward(message.SerializeToString())["data"]
    validated = [
        Datum(
            model_input=ModelInput.from_ints(datum.model_input.to_ints()),
            loss_fn_inputs={
                key: {"data": value.tolist(), "dtype": value.dtype, "shape": value.shape}
                for key, value in datum.loss_fn_inputs.items()
            },
        )
        for datum in sent
    ]
    assert [datum.model_dump() for datum in decoded] == [d.model_dump() for d in validated]
    message.data[0].loss_fn_inputs["weights"].shape[:] = [-1]
    with pytest.raises(ServeError) as refused:
        decode_forward_backward(message.SerializeToString())
    assert refused.value.status == 400
    assert "negative size" in refused.value.message
