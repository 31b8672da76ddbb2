"""`grpo serve` through pytrio 0.2.9's own client: every method, the loop, faults, errors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytrio
from pytrio import AdamParams, Datum, ModelInput, SamplingParams

from grpo.backends import pytrio as pytrio_backend
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME
from grpo.serve.faults import Fault, FaultPlan, parse_fault
from grpo.training.recipes.grpo.run import train
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import TINY

ADAM = AdamParams(learning_rate=1e-3)
TEXT = "12+34=46"


FORWARD_USAGE = ("usage/forward_tokens", "usage/cum_forward_tokens", "usage/cum_tokens")


def without_forward_usage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the forward-only token counts (they differ where the calls differ)."""
    return [{k: v for k, v in row.items() if k not in FORWARD_USAGE} for row in rows]


def run_rows(tmp_path: Path, name: str, **overrides: Any) -> list[dict[str, Any]]:
    """The metrics rows (timings dropped) of a quiet run of the loop."""
    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / name), **overrides})
    result = train(config, echo=lambda _line: None, progress=False)
    rows = read_metrics(result.run_dir)
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def datums(tokenizer: Any) -> list[Datum]:
    """Two policy-loss datums over a short arithmetic string."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    n = len(ids) - 1
    return [
        Datum(
            model_input=ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(ids[1:], dtype=np.int64),
                "logprobs": np.full(n, -1.0, dtype=np.float32),
                "advantages": np.full(n, sign, dtype=np.float32),
            },
        )
        for sign in (1.0, -0.5)
    ]


def doubled_loss(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    """A custom loss: -2 * sum(advantage * logprob)."""
    import torch

    total = sum(
        -2 * (lp * torch.tensor(d.loss_fn_inputs["advantages"].data)).sum()
        for d, lp in zip(data, logprobs, strict=True)
    )
    return total, {"custom/scale": 2.0}


def exercise(service: Any) -> dict[str, Any]:
    """Every training/sampling method once, on either client; returns what they computed."""
    out: dict[str, Any] = {"models": service.get_supported_models()}
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=8, seed=5)
    batch = datums(training.get_tokenizer())
    prompt = ModelInput.from_ints(batch[0].model_input.to_ints())
    out["forward"] = training.forward(batch, "ppo").result()
    out["fb"] = training.forward_backward(batch, "ppo").result()
    out["optim"] = training.optim_step(ADAM).result()
    out["custom"] = training.forward_backward_custom(batch, doubled_loss).result()
    out["optim2"] = training.optim_step(ADAM).result()
    state = training.save_state("state-1").result()
    weights = training.save_weights_for_sampler("sampler-1").result()
    sampler = training.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    out["sample"] = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    out["logprobs"] = sampler.compute_logprobs(prompt).result()
    # Unseeded: the service's seeded generator supplies the seed (compute_logprobs draws none).
    out["unseeded"] = sampler.sample(prompt, 2, SamplingParams(max_tokens=6)).result()
    out["saved_sample"] = (
        service.create_sampling_client(TINY_MODEL_NAME, weights.path)
        .sample(prompt, 2, params)
        .result()
    )
    out["base_sample"] = (
        service.create_sampling_client(TINY_MODEL_NAME).sample(prompt, 2, params).result()
    )
    out["named_sampler"] = (
        training.create_sampling_client(weights.path).compute_logprobs(prompt).result()
    )
    for name, restored in (
        ("with_optimizer", service.create_training_client_from_state_with_optimizer(state.path)),
        ("weights_only", service.create_training_client_from_state(state.path)),
    ):
        out[f"{name}_fb"] = restored.forward_backward(batch, "ppo").result()
        out[f"{name}_optim"] = restored.optim_step(ADAM).result()
    for load_optimizer in (True, False):
        fresh = service.create_lora_training_client(TINY_MODEL_NAME, rank=8, seed=5)
        load = fresh.load_state_with_optimizer if load_optimizer else fresh.load_state
        load(state.path).result()
        fresh.forward_backward(batch, "ppo").result()
        out[f"load_{load_optimizer}_optim"] = fresh.optim_step(ADAM).result()
    out["state"], out["training"] = state, training
    return out


def test_every_method_through_pytrio_computes_what_the_local_backend_computes(
    served: Any, tmp_path: Path
) -> None:
    remote = exercise(pytrio.ServiceClient())
    with LocalServiceClient(root=tmp_path / "in-process", seed=0) as service:
        local = exercise(service)
    assert remote["models"] == local["models"] == [TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME]
    for key in ("forward", "fb", "custom", "with_optimizer_fb", "weights_only_fb"):
        assert remote[key].metrics == pytest.approx(local[key].metrics, rel=1e-6), key
        for left, right in zip(
            remote[key].loss_fn_outputs, local[key].loss_fn_outputs, strict=True
        ):
            np.testing.assert_allclose(left["logprobs"].data, right["logprobs"].data, rtol=1e-6)
    assert set(remote["fb"].metrics) == {"loss_sum", "loss_mean", "token_count"}
    assert remote["custom"].metrics["custom/scale"] == 2.0
    for key in (
        "optim",
        "optim2",
        "with_optimizer_optim",
        "weights_only_optim",
        "load_True_optim",
        "load_False_optim",
    ):
        assert remote[key].metrics == pytest.approx(local[key].metrics, rel=1e-5), key
    # The optimizer state travels with the checkpoint only when asked for.
    assert remote["with_optimizer_optim"].metrics["optimizer_step"] == 3.0
    assert remote["weights_only_optim"].metrics["optimizer_step"] == 1.0
    for key in ("sample", "unseeded", "saved_sample", "base_sample"):
        assert [s.tokens for s in remote[key].sequences] == [s.tokens for s in local[key].sequences]
        for left, right in zip(remote[key].sequences, local[key].sequences, strict=True):
            np.testing.assert_allclose(left.logprobs, right.logprobs, rtol=1e-6)
    assert remote["sample"].prompt_logprobs == pytest.approx(local["sample"].prompt_logprobs)
    assert remote["logprobs"][0] is None
    assert remote["logprobs"][1:] == pytest.approx(local["logprobs"][1:], rel=1e-6)
    assert remote["named_sampler"][1:] == pytest.approx(local["named_sampler"][1:], rel=1e-6)
    # forward_backward_custom is two ordinary events: a forward, then a forward_backward.
    events = [
        kind for run, kind in served.state.events.log if run == remote["training"].training_run_cuid
    ]
    assert events[:6] == [
        "trainer.init_run",
        "trainer.forward",
        "trainer.forward_backward",
        "trainer.optimize_step",
        "trainer.forward",
        "trainer.forward_backward",
    ]


def test_capabilities_and_tokenizer_are_the_local_models(served: Any) -> None:
    service = pytrio.ServiceClient()
    local = LocalServiceClient(root=served.state.registry.root / "caps")
    models = service.get_server_capabilities().supported_models
    assert models == local.get_server_capabilities().supported_models
    assert [m.model_name for m in models] == [TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME]
    model = models[0]
    assert model.max_context_length == model.sampling.max_seq_len == model.training.max_seq_len
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4)
    tokenizer = training.get_tokenizer()  # pytrio's get_tokenizer, offline
    reference = local.create_lora_training_client(TINY_MODEL_NAME, rank=4).get_tokenizer()
    messages = [{"role": "user", "content": "What is 7*8?"}]
    for text in (
        TEXT,
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    ):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )
    assert tokenizer.model_max_length == reference.model_max_length == model.max_context_length
    local.close()


def test_async_twins(served: Any) -> None:
    async def session() -> tuple[Any, ...]:
        service = pytrio.ServiceClient()
        capabilities = await service.get_server_capabilities_async()
        training = await service.create_lora_training_client_async(TINY_MODEL_NAME, rank=4, seed=1)
        batch = datums(training.get_tokenizer())
        forward = await (await training.forward_async(batch, "ppo"))
        backward = await (await training.forward_backward_async(batch, "ppo"))
        custom = await (await training.forward_backward_custom_async(batch, doubled_loss))
        step = await (await training.optim_step_async(ADAM))
        state = await (await training.save_state_async("async-state"))
        weights = await (await training.save_weights_for_sampler_async("async-weights"))
        sampler = await training.save_weights_and_get_sampling_client_async()
        prompt = ModelInput.from_ints(batch[0].model_input.to_ints())
        response = await sampler.sample_async(prompt, 2, SamplingParams(max_tokens=3, seed=0))
        logprobs = await sampler.compute_logprobs_async(prompt)
        other = await service.create_sampling_client_async(TINY_MODEL_NAME, weights.path)
        await other.sample_async(prompt, 1, SamplingParams(max_tokens=2, seed=0))
        restored = await service.create_training_client_from_state_with_optimizer_async(state.path)
        loaded = await service.create_lora_training_client_async(TINY_MODEL_NAME, rank=4, seed=1)
        await (await loaded.load_state_async(state.path))
        weights_only = await service.create_training_client_from_state_async(state.path)
        await training.create_sampling_client_async(weights.path)
        return (
            capabilities,
            forward,
            backward,
            custom,
            step,
            response,
            logprobs,
            restored,
            weights_only,
        )

    capabilities, forward, backward, custom, step, response, logprobs, *clients = asyncio.run(
        session()
    )
    assert capabilities.supported_models[0].model_name == TINY_MODEL_NAME
    assert forward.metrics["token_count"] == backward.metrics["token_count"] > 0
    assert custom.metrics["custom/scale"] == 2.0 and step.metrics["optimizer_step"] == 1.0
    assert len(response.sequences) == 2 and len(logprobs) == len(
        response.prompt_logprobs or logprobs
    )
    assert all(client.training_run_cuid for client in clients)


def test_rest_client_lists_downloads_and_deletes_checkpoints(served: Any, tmp_path: Path) -> None:
    service = pytrio.ServiceClient()
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    state = training.save_state("kept").result()
    training.save_weights_for_sampler("for-sampling").result()
    sampler = training.save_weights_and_get_sampling_client()  # temporary: not listed
    rest = service.create_rest_client()
    run = rest.get_training_run(training.training_run_cuid).result()
    assert run.base_model == TINY_MODEL_NAME and run.lora_rank == 4 and run.is_lora
    runs = rest.list_training_runs().result()
    assert training.training_run_cuid in [r.training_run_id for r in runs.training_runs]
    listed = rest.list_checkpoints(training.training_run_cuid).result().checkpoints
    assert [(c.checkpoint_type, c.path) for c in listed][0] == ("training", state.path)
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    assert len(rest.list_user_checkpoints().result().checkpoints) == 2
    kept = listed[0]
    archive = tmp_path / "kept.tar"
    result = rest.download_checkpoint(kept.checkpoint_id, archive).result()
    assert result.bytes_written == archive.stat().st_size > 0
    with tarfile.open(archive) as tar:
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= set(
            tar.getnames()
        )
    assert rest.get_checkpoint_download_url(kept.checkpoint_id).result().url.startswith(served.url)
    rest.delete_checkpoint(training.training_run_cuid, kept.checkpoint_id).result()
    assert [
        c.checkpoint_type
        for c in rest.list_checkpoints(training.training_run_cuid).result().checkpoints
    ] == ["sampler"]
    assert not Path(state.path.removeprefix("local://")).exists()
    assert rest.get_sampler(sampler.sampling_run_cuid).result().base_model == TINY_MODEL_NAME
    session = rest.get_session(service.service_session_cuid).result()
    assert training.training_run_cuid in session.training_run_ids
    assert service.service_session_cuid in rest.list_sessions().result().sessions


def test_a_request_without_the_api_key_gets_401(served: Any) -> None:
    request = urllib.request.Request(f"{served.url}/api/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
    started = time.monotonic()
    with pytest.raises(pytrio.PyTrioError, match="API key"):
        pytrio.ServiceClient(api_key="wrong-key")
    assert time.monotonic() - started < 5


def test_bad_requests_fail_at_once_and_leave_the_run_usable(served: Any) -> None:
    service = pytrio.ServiceClient()
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    batch = datums(training.get_tokenizer())
    started = time.monotonic()
    with pytest.raises(pytrio.PyTrioError, match="loss_fn_config") as failed:
        training.forward_backward(batch, "ppo", {"no_such_option": 1.0}).result()
    assert failed.value.code.startswith("validation.") and not failed.value.retryable
    limit = service.get_server_capabilities().supported_models[0].max_context_length
    sampler = training.save_weights_and_get_sampling_client()
    with pytest.raises(pytrio.PyTrioError, match="positions") as too_long:
        prompt = ModelInput.from_ints([5] * (limit - 10))
        sampler.sample(prompt, 1, SamplingParams(max_tokens=50)).result()
    assert too_long.value.status_code == 400 and not too_long.value.retryable
    with pytest.raises(pytrio.PyTrioError, match="not served here") as unknown:
        service.create_lora_training_client("no/such-model", rank=4)
    assert unknown.value.status_code == 404
    with pytest.raises(pytrio.PyTrioError, match="checkpoint"):
        service.create_training_client_from_state("local:///no/such/checkpoint")
    assert time.monotonic() - started < 10
    assert training.forward_backward(batch, "ppo").result().metrics["token_count"] > 0


@pytest.mark.parametrize("custom_loss", [False, True], ids=["builtin", "custom"])
def test_the_loop_through_the_server_equals_the_local_backend(
    served: Any, tmp_path: Path, custom_loss: bool
) -> None:
    options = dict(loss_fn="ppo", custom_loss=custom_loss, eval_every=2, eval_limit=4)
    remote = run_rows(tmp_path, "remote", backend="pytrio", **options)
    local = run_rows(tmp_path, "local", backend="local", **options)
    # Same seed, same numbers: the server runs the same local-backend code. Only the usage
    # differs: pytrio's SDK runs a custom loss as a forward, then a forward_backward.
    extra = [r["usage/forward_tokens"] - lo["usage/forward_tokens"] for r, lo in zip(remote, local)]
    assert extra == [row["usage/trained_tokens"] if custom_loss else 0 for row in remote]
    assert_same_rows(without_forward_usage(remote), without_forward_usage(local))
    assert [row["step"] for row in remote] == [0, 1, 2] and "test/reward" in remote[-1]


def test_an_env_run_on_the_tool_model_through_the_server_equals_the_local_backend(
    served: Any, tmp_path: Path
) -> None:
    """--env (multi-turn episodes, tool calls) on the built-in tool model, served by name.

    Every group scores 0 (nothing trains), so every metric is a count of sampled tokens and
    one token sampled differently fails the comparison. With requests in flight together
    the sampler's batches depend on timing, and on a BLAS whose rows round by the batch's
    row count (tests/invariance.py) a request's log-probs then move by up to ~5e-6 (measured
    with the sampler's row padding off: 4.2e-6 and 5.2e-6 between two such runs, 0 at
    concurrency 1); a draw that falls that close to a CDF boundary picks another token (the
    likely cause of its one failure). One request at a time gives both runs one-request
    batches of the same shapes, so the same floats and tokens on any CPU."""
    options = dict(
        env="grpo.envs:calculator_wordproblems",
        dataset="wordproblems",
        base_model=TINY_TOOLS_MODEL_NAME,
        max_tokens=48,
        steps=2,
        eval_every=2,
        eval_limit=4,
        concurrency=1,
    )
    remote = run_rows(tmp_path, "remote", backend="pytrio", **options)
    local = run_rows(tmp_path, "local", backend="local", **options)
    assert_same_rows(remote, local)
    assert remote[-1]["test/tool_use"] > 0 and remote[1]["env/tool_calls"] > 0


def test_resume_through_the_server_continues_like_an_uninterrupted_run(
    served: Any, tmp_path: Path
) -> None:
    whole = run_rows(tmp_path, "whole", backend="local", steps=4)
    run_rows(tmp_path, "resumed", backend="pytrio", steps=2)
    config = TrainConfig(
        **{**TINY, "run_dir": str(tmp_path / "resumed"), "backend": "pytrio", "steps": 4}
    )
    train(config, resume=True, echo=lambda _line: None, progress=False)
    rows = read_metrics(tmp_path / "resumed")
    timed = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]
    # The 2-step run's final checkpoint check is one forward the whole run did not do.
    assert_same_rows(without_forward_usage(timed), without_forward_usage(whole))


def test_transient_faults_are_retried_by_pytrio_and_the_run_equals_the_clean_one(
    served: Any, tmp_path: Path
) -> None:
    clean = run_rows(tmp_path, "clean", backend="pytrio")
    served.faults.faults = tuple(
        parse_fault(spec)
        for spec in (
            "sample:503:first=3",
            "forward_backward:500:first=1",
            "optimize_step:429:calls=2",
            "get_event:503:every=4",
            "create_sampling_run:502:first=1",
            "init_run:503:first=1",
            "save_state:delay=0.2:first=1",
        )
    )
    faulty = run_rows(tmp_path, "faulty", backend="pytrio")
    assert_same_rows(faulty, clean)
    injected = {operation for operation, _number, _what in served.faults.injected}
    assert {
        "sample",
        "forward_backward",
        "optimize_step",
        "create_sampling_run",
        "init_run",
    } <= injected


def test_the_loops_retries_take_over_when_pytrio_gives_up(
    served: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = run_rows(tmp_path, "clean", backend="pytrio")
    sleeps: list[float] = []
    monkeypatch.setattr(pytrio_backend.time, "sleep", sleeps.append)
    pytrio.configure(sampling_retry_timeout_seconds=0)  # pytrio raises the first 503 at once
    served.faults.faults = (Fault("sample", status=503, calls=(1, 2, 5)),)
    assert_same_rows(run_rows(tmp_path, "retried", backend="pytrio"), clean)
    assert served.faults.count("sample") == 3 and len(sleeps) == 3


def test_an_unreachable_service_fails_within_the_connect_timeout(pytrio_home: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # nothing listens once closed
    pytrio.configure(base_url=url, api_key="any")
    started = time.monotonic()
    with pytest.raises(pytrio_backend.BackendUnavailableError) as unreachable:
        pytrio_backend.make_service_client("pytrio", connect_timeout_s=1.0)
    assert time.monotonic() - started < 5
    assert url in str(unreachable.value) and "grpo serve" in str(unreachable.value)


def test_check_capabilities_names_the_limit_and_the_fix(served: Any) -> None:
    for service in (
        pytrio.ServiceClient(),
        LocalServiceClient(root=served.state.registry.root / "caps2"),
    ):
        limit = service.get_server_capabilities().supported_models[0].max_context_length
        pytrio_backend.check_capabilities(service, TINY_MODEL_NAME, limit - 24, 24)
        with pytest.raises(
            pytrio_backend.CapabilityError, match=f"lower --max-tokens to {limit - 100}"
        ):
            pytrio_backend.check_capabilities(service, TINY_MODEL_NAME, 100, limit)
        with pytest.raises(pytrio_backend.CapabilityError, match="not served"):
            pytrio_backend.check_capabilities(service, "no/such-model", 10, 10)


def test_configure_concurrency_raises_pytrios_in_flight_limit(served: Any) -> None:
    pytrio_backend.configure_concurrency(40)
    service = pytrio_backend.make_service_client("pytrio")
    assert service._runtime.configuration.sampling_request_max_in_flight == 40
    with pytest.raises(ValueError, match="--concurrency"):
        pytrio_backend.configure_concurrency(0)


def test_fault_specs_parse_and_select_deterministically() -> None:
    assert parse_fault("sample:503:first=2") == Fault("sample", status=503, first=2)
    assert parse_fault("forward_backward:delay=0.5:every=3") == Fault(
        "forward_backward", delay_s=0.5, every=3
    )
    for bad in ("sample", "sample:404", "sample:503:sometimes=1", "sample:delay=0"):
        with pytest.raises(ValueError, match="--fault"):
            parse_fault(bad)
    decisions = []
    for _ in range(2):
        plan = FaultPlan([Fault("sample", status=503, probability=0.5)], seed=3)
        decisions.append([plan.decide("sample")[0] for _ in range(20)])
    assert decisions[0] == decisions[1] and 0 < decisions[0].count(503) < 20
    plan = FaultPlan([Fault("*", status=429, every=2)])
    assert [plan.decide(op)[0] for op in ("a", "a", "b", "b")] == [None, 429, None, 429]


@pytest.mark.slow
def test_grpo_serve_cli_prints_the_variables_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "GRPO_SERVE_API_KEY": "cli-key", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "grpo", "serve", "--port", "0", "--root", str(tmp_path / "root")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = [server.stdout.readline() for _ in range(5)]
        url = next(line.split("=", 1)[1].strip() for line in lines if "PYTRIO_BASE_URL=" in line)
        assert any(
            "PYTRIO_API_KEY=<the key" in line for line in lines
        ) and "cli-key" not in "".join(lines)
        client = subprocess.run(
            [
                sys.executable,
                "-c",
                "import pytrio; pytrio.configure_observability(enabled=False); "
                "print(pytrio.ServiceClient().get_supported_models())",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "PYTRIO_BASE_URL": url, "PYTRIO_API_KEY": "cli-key", "HOME": str(tmp_path)},
        )
        assert TINY_MODEL_NAME in client.stdout, client.stderr
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert "stopping" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()


def test_the_local_client_accepts_pytrio_extras(tmp_path: Path) -> None:
    with LocalServiceClient("ignored-api-key", root=tmp_path) as service:
        training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4)
        output = training.forward(datums(training.get_tokenizer()), "ppo").result()
        assert set(output.metrics) == {"loss_sum", "loss_mean", "token_count"}
        state = training.save_state("kept", ttl_seconds=60).result()
        weights = training.save_weights_for_sampler("weights").result()
        rest = service.create_rest_client()
        listed = rest.list_checkpoints(training.training_run_cuid).result().checkpoints
        assert [(c.checkpoint_type, c.path) for c in listed] == [
            ("training", state.path),
            ("sampler", weights.path),
        ]
        assert listed[0].expires_at is not None and listed[1].expires_at is None
        page = asyncio.run(rest.list_user_checkpoints_async(limit=1))
        assert len(page.checkpoints) == 1 and page.cursor.total_count == 2
        rest.delete_checkpoint(training.training_run_cuid, listed[0].checkpoint_id).result()
        assert not Path(state.path.removeprefix("local://")).exists()
        with pytest.raises(pytrio.PyTrioError, match="list_checkpoints"):
            rest.delete_checkpoint("another-run", listed[1].checkpoint_id)
        training.close()
        asyncio.run(training.close_async())


def test_a_model_alias_lets_a_program_that_asks_for_another_model_run(tmp_path: Path) -> None:
    from grpo.serve.client import configured_pytrio
    from grpo.serve.server import serve_in_thread

    alias = "Qwen/Qwen3.5-4B"
    with (
        serve_in_thread(root=tmp_path / "served", aliases={alias: TINY_MODEL_NAME}) as handle,
        configured_pytrio(handle.url, api_key="any", home=tmp_path),
    ):
        service = pytrio.ServiceClient()
        assert service.get_supported_models() == [TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME, alias]
        training = service.create_lora_training_client(alias, rank=4, seed=0)
        batch = datums(training.get_tokenizer())
        assert training.forward(batch, "ppo").result().metrics["token_count"] > 0
        sampler = training.save_weights_and_get_sampling_client()
        assert sampler.sample(batch[0].model_input, 1, SamplingParams(max_tokens=2)).result()
    with pytest.raises(ValueError, match="--model-alias"):
        serve_in_thread(root=tmp_path / "bad", aliases={alias: "no/such-model"})
