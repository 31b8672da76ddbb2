"""The local backend's trainer: losses vs custom losses, gradients, AdamW, checkpoints, seeds.

Runs on a randomly initialised tiny model (`init_tiny_model(0)`) so results do not depend
on the shipped warm-started weights.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from pytrio.errors.base import ValidationError
from pytrio.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

from grpo.backends.datums import scale_weights
from grpo.backends.local import (
    LocalSamplingClient,
    LocalServiceClient,
    LocalTrainingClient,
    tiny,
)
from grpo.training.custom_loss import as_custom_loss

MODEL = tiny.TINY_MODEL_NAME
ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(autouse=True)
def random_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny, "load_tiny_model", lambda *_: tiny.init_tiny_model(0))


@pytest.fixture
def service(tmp_path) -> LocalServiceClient:
    with LocalServiceClient(root=tmp_path / "checkpoints", seed=0, kernel_metrics=True) as client:
        yield client


def policy_datums(count: int = 3, seed: int = 0, prompt_length: int = 12) -> list[Datum]:
    """GRPO-shaped datums: prompt positions masked (advantage 0), completions with A and lp_old."""
    rng = np.random.default_rng(seed)
    datums = []
    for index in range(count):
        completion = int(rng.integers(4, 12))
        tokens = rng.integers(4, 90, prompt_length + completion)
        advantages = np.zeros(len(tokens) - 1, dtype=np.float32)
        advantages[prompt_length - 1 :] = rng.choice([-1.0, 0.5, 1.0]) * (index + 1)
        sampling_logprobs = np.zeros(len(tokens) - 1, dtype=np.float32)
        sampling_logprobs[prompt_length - 1 :] = rng.uniform(-5.5, -3.5, completion)
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(tokens[1:].astype(np.int64)),
                    "logprobs": TensorData.from_numpy(sampling_logprobs),
                    "advantages": TensorData.from_numpy(advantages),
                },
            )
        )
    return datums


def lora_state(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    return {
        key: tensor.detach().clone()
        for key, tensor in client._host.adapter_parameters(client._adapter).items()
    }


def gradients(client: LocalTrainingClient) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in client._parameters]


def train(client: LocalTrainingClient, datums: list[Datum], steps: int, loss: str = "ppo") -> None:
    for _ in range(steps):
        client.forward_backward(datums, loss).result()
        client.optim_step(ADAM).result()


@pytest.mark.parametrize(
    ("loss", "config"),
    [
        ("importance_sampling", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", {"clip_high_threshold": 2.0}),
        ("dro", {"beta": 0.1}),
        ("ppo", {"reduction": "token_mean"}),
        ("importance_sampling", {"reduction": "seq_mean_token_sum_norm", "norm_length": 16.0}),
    ],
)
def test_builtin_loss_and_custom_loss_give_the_same_loss_and_gradients(tmp_path, loss, config):
    datums = policy_datums()
    kernel_config = {
        key: value for key, value in config.items() if key not in ("reduction", "norm_length")
    }
    results = []
    for path in ("builtin", "custom"):
        with LocalServiceClient(root=tmp_path, seed=0, kernel_metrics=True) as service:
            client = service.create_lora_training_client(MODEL, rank=4, seed=3)
            train(client, datums, steps=1)  # move the ratio away from 1 so clipping matters
            if path == "builtin":
                output = client.forward_backward(datums, loss, config).result()
            else:
                custom = as_custom_loss(
                    loss,
                    datums,
                    reduction=config.get("reduction", "sum"),
                    norm_length=config.get("norm_length"),
                    **kernel_config,
                )
                output = client.forward_backward_custom(datums, custom).result()
            results.append((output, gradients(client)))
    (builtin, builtin_grads), (custom, custom_grads) = results
    assert builtin.metrics[f"{loss}/loss"] == pytest.approx(
        custom.metrics[f"{loss}/loss"], rel=1e-6, abs=1e-6
    )
    # Every kernel metric (ratios, clip shares, tokens) appears on both paths, with one value.
    prefix = f"{loss}/"
    builtin_kernel = {k: v for k, v in builtin.metrics.items() if k.startswith(prefix)}
    custom_kernel = {k: v for k, v in custom.metrics.items() if k.startswith(prefix)}
    assert {prefix + "ratio_mean", prefix + "clip_fraction"} <= builtin_kernel.keys()
    assert builtin_kernel.keys() == custom_kernel.keys()
    assert builtin_kernel == pytest.approx(custom_kernel, rel=1e-6, abs=1e-6)
    for left, right in zip(builtin_grads, custom_grads, strict=True):
        torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-7)
    assert any(float(grad.abs().sum()) > 0 for grad in builtin_grads)


def test_gradients_accumulate_until_optim_step(service):
    """Under the default (each request's loss over its samples) two halves, advantages
    pre-scaled by n_k / N = 1/2 as the series' chapters do, add up to the whole's gradient."""
    assert service.service_normalization == "samples"
    datums = policy_datums(4)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    for half in (datums[:2], datums[2:]):
        scaled = scale_weights(half, 0.5, "advantages")
        client.forward_backward(scaled, "importance_sampling").result()
    accumulated = gradients(client)
    other = service.create_lora_training_client(MODEL, rank=4, seed=0)
    other.forward_backward(datums, "importance_sampling").result()
    for left, right in zip(accumulated, gradients(other), strict=True):
        torch.testing.assert_close(left, right, rtol=1e-4, atol=1e-6)
    response = client.optim_step(ADAM).result()
    assert gradients(client) == [None] * len(accumulated)
    assert response.metrics["grad_norm"] > 0 and response.metrics["optimizer_step"] == 1.0


def test_training_moves_only_the_lora_weights(service):
    client = service.create_lora_training_client(MODEL, rank=8, seed=0)
    base = {
        name: p.clone() for name, p in client._host.model.named_parameters() if "lora_" not in name
    }
    before = lora_state(client)
    train(client, policy_datums(), steps=3)
    after_base = {
        name: p for name, p in client._host.model.named_parameters() if "lora_" not in name
    }
    assert base.keys() == after_base.keys()
    assert all(torch.equal(base[name], after_base[name]) for name in base)
    assert any(not torch.equal(before[key], value) for key, value in lora_state(client).items())
    assert {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in before} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    }


def test_a_fresh_adapter_leaves_the_model_unchanged_and_its_seed_fixes_it(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=9)
    same = service.create_lora_training_client(MODEL, rank=4, seed=9)
    other = service.create_lora_training_client(MODEL, rank=4, seed=10)
    assert all(
        torch.equal(a, b) for a, b in zip(lora_state(client).values(), lora_state(same).values())
    )
    assert any(
        not torch.equal(a, b)
        for a, b in zip(lora_state(client).values(), lora_state(other).values())
    )
    tokens = datums[0].model_input.to_ints() + [datums[0].loss_fn_inputs["target_tokens"].data[-1]]
    base = (
        service.create_sampling_client(MODEL)
        .compute_logprobs(ModelInput.from_ints(tokens))
        .result()
    )
    trained = np.asarray(
        client.forward(datums[:1], "ppo").result().loss_fn_outputs[0]["logprobs"].data
    )
    np.testing.assert_allclose(base[1:], trained, atol=1e-5)


def test_lora_options_choose_the_target_modules(service):
    client = service.create_lora_training_client(
        MODEL, rank=4, seed=0, train_mlp=False, train_unembed=False
    )
    modules = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in lora_state(client)}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValidationError) as error:
        service.create_lora_training_client(
            MODEL, train_mlp=False, train_attn=False, train_unembed=False
        )
    assert error.value.code == "validation.invalid_lora_config"
    with pytest.raises(ValidationError) as error:
        service.create_lora_training_client(MODEL, rank=3)
    assert error.value.code == "validation.invalid_lora_rank"


def test_save_then_resume_with_optimizer_continues_bit_for_bit(service):
    datums = policy_datums()
    client = service.create_lora_training_client(MODEL, rank=8, seed=2)
    train(client, datums, steps=2)
    saved = client.save_state("step2").result()
    at_save = lora_state(client)
    train(client, datums, steps=2)
    uninterrupted = lora_state(client)

    resumed = service.create_training_client_from_state_with_optimizer(saved.path)
    train(resumed, datums, steps=2)
    assert all(torch.equal(uninterrupted[key], value) for key, value in lora_state(resumed).items())

    loaded = service.create_lora_training_client(MODEL, rank=8, seed=5)
    loaded.load_state_with_optimizer(saved.path).result()
    train(loaded, datums, steps=2)
    assert all(torch.equal(uninterrupted[key], value) for key, value in lora_state(loaded).items())

    weights_only = service.create_training_client_from_state(saved.path)
    assert all(torch.equal(at_save[key], value) for key, value in lora_state(weights_only).items())
    train(weights_only, datums, steps=2)  # a fresh Adam state takes other steps
    assert any(
        not torch.equal(uninterrupted[key], value)
        for key, value in lora_state(weights_only).items()
    )
    assert saved.path.startswith("local://") and saved.model == MODEL and saved.size > 0


@pytest.mark.filterwarnings(
    "ignore:.*tie_word_embeddings:UserWarning", "ignore:.*is_gradient_checkpointing:FutureWarning"
)
def test_checkpoints_are_peft_adapter_directories(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=1)
    train(client, datums, steps=1)
    directory = Path(client.save_state("peft").result().path.removeprefix("local://"))
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.pt",
        "grpo_local.json",
    } <= {file.name for file in directory.iterdir()}
    assert json.loads((directory / "adapter_config.json").read_text())["lora_alpha"] == 32
    model, _ = tiny.init_tiny_model(0)
    peft_model = PeftModel.from_pretrained(model, str(directory))
    tokens = datums[0].model_input.to_ints()
    targets = torch.tensor(datums[0].loss_fn_inputs["target_tokens"].data)
    with torch.no_grad():
        logprobs = torch.log_softmax(peft_model(input_ids=torch.tensor([tokens])).logits[0], -1)
    expected = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).numpy()
    local_logprobs = np.asarray(
        client.forward(datums[:1], "ppo").result().loss_fn_outputs[0]["logprobs"].data
    )
    np.testing.assert_allclose(local_logprobs, expected, atol=1e-5)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(service, monkeypatch):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=1)
    train(client, datums, steps=1)
    first = client.save_state("latest").result()
    at_first_save = lora_state(client)
    train(client, datums, steps=1)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        client.save_state("latest", overwrite=True).result()
    monkeypatch.undo()
    parent = Path(first.path.removeprefix("local://")).parent
    assert [path.name for path in parent.iterdir()] == ["latest"]  # no half-written directory left
    restored = service.create_training_client_from_state_with_optimizer(first.path)
    assert all(
        torch.equal(at_first_save[key], value) for key, value in lora_state(restored).items()
    )

    with pytest.raises(ValidationError) as error:
        client.save_state("latest").result()
    assert error.value.code == "validation.checkpoint_exists"
    replaced = client.save_state("latest", overwrite=True).result()
    assert replaced.path == first.path
    assert [path.name for path in parent.iterdir()] == ["latest"]


def test_load_state_only_before_training_and_only_a_matching_config(service):
    client = service.create_lora_training_client(MODEL, rank=4, seed=1)
    train(client, policy_datums(2), steps=1)
    saved = client.save_state("c").result()
    with pytest.raises(ValidationError) as error:
        client.load_state(saved.path)
    assert error.value.code == "validation.already_initialized"
    mismatched = service.create_lora_training_client(MODEL, rank=8, seed=1)
    with pytest.raises(ValidationError) as error:
        mismatched.load_state(saved.path)
    assert error.value.code == "validation.checkpoint_config_mismatch"
    assert "lora_rank (target=8, source=4)." in str(error.value)
    other_seed = service.create_lora_training_client(MODEL, rank=4, seed=2, train_mlp=False)
    with pytest.raises(ValidationError) as error:
        other_seed.load_state(saved.path)  # the seed may differ; train_mlp may not
    assert str(error.value).startswith(
        "Checkpoint configuration is incompatible: train_mlp (target=False, source=True)."
    )
    sampler_only = client.save_weights_for_sampler("s").result()
    fresh = service.create_lora_training_client(MODEL, rank=4, seed=1)
    with pytest.raises(ValidationError) as error:
        fresh.load_state_with_optimizer(sampler_only.path)
    assert error.value.code == "validation.checkpoint_without_optimizer"
    with pytest.raises(ValidationError) as error:
        service.create_training_client_from_state("local:///nowhere/at/all")
    assert error.value.code == "validation.checkpoint_not_found"


def test_the_same_seed_gives_the_same_trajectory(tmp_path):
    def run(seed: int) -> dict[str, torch.Tensor]:
        with LocalServiceClient(root=tmp_path, seed=seed) as service:
            client = service.create_lora_training_client(MODEL, rank=4)
            sampler = client.save_weights_and_get_sampling_client()
            prompt = list(range(10, 30))
            for _ in range(2):
                response = sampler.sample(
                    ModelInput.from_ints(prompt), 3, SamplingParams(max_tokens=6)
                ).result()
                datums = []
                for index, sequence in enumerate(response.sequences):
                    tokens = prompt + sequence.tokens
                    advantages = np.zeros(len(tokens) - 1, dtype=np.float32)
                    advantages[len(prompt) - 1 :] = index - 1.0
                    logprobs = np.zeros(len(tokens) - 1, dtype=np.float32)
                    logprobs[len(prompt) - 1 :] = sequence.logprobs
                    datums.append(
                        Datum(
                            model_input=ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": TensorData.from_numpy(
                                    np.array(tokens[1:], dtype=np.int64)
                                ),
                                "logprobs": TensorData.from_numpy(logprobs),
                                "advantages": TensorData.from_numpy(advantages),
                            },
                        )
                    )
                train(client, datums, steps=1)
                sampler = client.save_weights_and_get_sampling_client()
            return lora_state(client)

    first, again, other = run(4), run(4), run(5)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first)


def _with_input(datum: Datum, key: str, values: object) -> Datum:
    inputs = dict(datum.loss_fn_inputs)
    inputs[key] = TensorData.model_validate(values)
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def _sized(datum: Datum, value: float, dtype: type) -> np.ndarray:
    return np.full(len(datum.model_input), value, dtype=dtype)


@pytest.mark.parametrize(
    ("corrupt", "loss", "config", "error_type"),
    [
        (lambda d: _with_input(d, "advantages", [1.0, 2.0]), "ppo", None, ValueError),
        (
            lambda d: _with_input(d, "target_tokens", _sized(d, 10_000, np.int64)),
            "ppo",
            None,
            ValidationError,
        ),
        (
            lambda d: _with_input(d, "target_tokens", _sized(d, 1, np.float32)),
            "ppo",
            None,
            ValueError,
        ),
        (
            lambda d: _with_input(d, "logprobs", _sized(d, np.nan, np.float32)),
            "ppo",
            None,
            ValueError,
        ),
        (
            lambda d: _with_input(d, "mask", _sized(d, 0.5, np.float32)),
            "ppo",
            None,
            ValidationError,
        ),
        (
            lambda d: Datum(
                model_input=ModelInput.from_ints([5, 999]), loss_fn_inputs=d.loss_fn_inputs
            ),
            "ppo",
            None,
            ValidationError,
        ),
        (
            lambda d: Datum(
                model_input=ModelInput.from_ints([5] * 2100), loss_fn_inputs=d.loss_fn_inputs
            ),
            "ppo",
            None,
            ValidationError,
        ),
        (lambda d: d, "gspo", None, ValueError),
        (lambda d: d, "ppo", {"clip_epsilon": 0.2}, ValidationError),
        (lambda d: d, "ppo", {"reduction": "mean"}, ValidationError),
    ],
)
def test_bad_training_input_raises_before_any_compute(service, corrupt, loss, config, error_type):
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    datums = policy_datums(2)
    datums[1] = corrupt(datums[1])
    with pytest.raises(error_type):
        client.forward_backward(datums, loss, config)
    assert gradients(client) == [None] * len(client._parameters)


def test_forward_reports_logprobs_and_metrics_without_gradients(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    output = client.forward(datums, "cispo").result()
    assert gradients(client) == [None] * len(client._parameters)
    assert [len(o["logprobs"].data) for o in output.loss_fn_outputs] == [
        len(d.model_input) for d in datums
    ]
    assert {
        "loss_sum",
        "loss_mean",
        "token_count",
        "cispo/clip_fraction",
        "cispo/ratio_mean",
    } <= set(output.metrics)
    # pytrio's count: every target that is not -100 (prompt positions too), not the trained ones
    active = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in datums)
    assert output.metrics["token_count"] == active
    assert output.metrics["loss_mean"] == pytest.approx(output.metrics["loss_sum"] / active)


def test_without_kernel_metrics_the_metrics_are_pytrios_keys_only(tmp_path):
    with LocalServiceClient(root=tmp_path, seed=0) as plain:
        client = plain.create_lora_training_client(MODEL, rank=4, seed=0)
        output = client.forward(policy_datums(2), "ppo").result()
    assert set(output.metrics) == {"loss_sum", "loss_mean", "token_count"}


def test_auto_shift_aligns_targets_with_inputs(service):
    tokens = list(range(10, 30))
    datum = Datum(
        model_input=ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": TensorData.from_numpy(np.array(tokens, dtype=np.int64))},
    )
    shifted = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))
        },
    )
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    auto = client.forward([datum], auto_shift=True).result()
    plain = client.forward([shifted]).result()
    logprobs = np.asarray(auto.loss_fn_outputs[0]["logprobs"].data)
    assert logprobs[0] == 0.0
    np.testing.assert_allclose(logprobs[1:], plain.loss_fn_outputs[0]["logprobs"].data, atol=1e-5)
    assert auto.metrics["token_count"] == plain.metrics["token_count"] == len(tokens) - 1


def test_optim_step_clips_gradients_and_validates_its_parameters(service):
    datums = policy_datums(2)
    changes = []
    for clip in (0.0, 1e-6):
        client = service.create_lora_training_client(MODEL, rank=4, seed=0)
        before = lora_state(client)
        client.forward_backward(datums, "importance_sampling").result()
        # A large eps makes the step proportional to the gradient, so clipping shows.
        client.optim_step(AdamParams(learning_rate=1.0, eps=1.0, grad_clip_norm=clip)).result()
        changes.append(
            sum(
                float((value - before[key]).abs().sum())
                for key, value in lora_state(client).items()
            )
        )
    assert changes[1] < changes[0] * 1e-3
    for bad in (
        {"learning_rate": -1.0},
        {"beta1": 1.0},
        {"eps": 0.0},
        {"grad_clip_norm": float("nan")},
    ):
        with pytest.raises(ValidationError) as error:
            client.optim_step(AdamParams(**bad))
        assert error.value.code == "validation.invalid_adam_params"


def test_custom_loss_without_gradient_is_rejected(service):
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    datums = policy_datums(2)

    def first_datum_only(data, logprobs):
        return -logprobs[0].sum(), {"custom/value": 1.0}

    with pytest.raises(ValidationError) as error:
        client.forward_backward_custom(datums, first_datum_only).result()
    assert error.value.code == "validation.missing_custom_loss_gradient"

    def with_config(data, logprobs, config):
        return -config["scale"] * sum(lp.sum() for lp in logprobs), {
            "custom/scale": config["scale"]
        }

    output = client.forward_backward_custom(datums, with_config, {"scale": 2.0}).result()
    assert output.metrics["custom/scale"] == 2.0 and {"loss_sum", "token_count"} <= set(
        output.metrics
    )


def test_unknown_base_model_names_the_choices(service):
    with pytest.raises(ValidationError) as error:
        service.create_lora_training_client("Qwen/Qwen3-8B")
    assert MODEL in str(error.value) and "directory" in str(error.value)
    assert service.get_supported_models()[0] == MODEL


def test_a_local_hugging_face_directory_is_a_base_model(service, tmp_path):
    model, tokenizer = tiny.init_tiny_model(0)
    directory = tmp_path / "hf-model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    client = service.create_lora_training_client(str(directory), rank=4, seed=0)
    assert client.model_id == str(directory.resolve())
    train(client, policy_datums(2), steps=1)
    response = (
        client.save_weights_and_get_sampling_client()
        .sample(ModelInput.from_ints(list(range(10, 20))), 2, SamplingParams(max_tokens=5, seed=1))
        .result()
    )
    assert len(response.sequences) == 2 and all(1 <= len(s.tokens) <= 5 for s in response.sequences)
    saved = client.save_state("hf").result()
    assert service.create_training_client_from_state(saved.path).model_id == client.model_id


def test_async_twins_return_what_pytrio_returns(service):
    datums = policy_datums(2)

    async def session() -> tuple[object, ...]:
        client = await service.create_lora_training_client_async(MODEL, rank=4, seed=0)
        backward = await client.forward_backward_async(datums, "ppo")
        output = await backward
        step = await (await client.optim_step_async(ADAM))
        saved = await (await client.save_state_async("async"))
        sampler = await client.save_weights_and_get_sampling_client_async()
        prompt = ModelInput.from_ints(list(range(10, 20)))
        response = await sampler.sample_async(prompt, 2, SamplingParams(max_tokens=3))
        restored = await service.create_training_client_from_state_with_optimizer_async(saved.path)
        return output, step, response, restored

    output, step, response, restored = asyncio.run(session())
    assert output.metrics["ppo/train_tokens"] > 0 and step.metrics["optimizer_step"] == 1.0
    assert len(response.sequences) == 2
    assert isinstance(restored, LocalTrainingClient)


@pytest.mark.parametrize(
    "client_class", [LocalServiceClient, LocalTrainingClient, LocalSamplingClient]
)
def test_every_async_twin_is_a_coroutine_taking_its_sync_calls_arguments(client_class):
    twins = [name for name in vars(client_class) if name.endswith("_async")]
    assert twins
    for name in twins:
        twin, call = getattr(client_class, name), getattr(client_class, name.removesuffix("_async"))
        assert inspect.iscoroutinefunction(twin), name
        assert inspect.signature(twin).parameters == inspect.signature(call).parameters, name


# --- numbers never poison the adapter ------------------------------------------------------


def optimizer_state(client: LocalTrainingClient) -> dict[int, dict[str, torch.Tensor]]:
    return {
        index: {key: value.clone() for key, value in state.items()}
        for index, state in client._optimizer.state_dict()["state"].items()
    }


def _same_state(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(
        first[index].keys() == second[index].keys()
        and all(torch.equal(first[index][key], second[index][key]) for key in first[index])
        for index in first
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_custom_loss_is_rejected_before_any_gradient(service, bad):
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)

    def poisoned(data, logprobs):
        return -bad * sum(lp.sum() for lp in logprobs), {}  # log-probs are < 0: +inf, or NaN

    with pytest.raises(ValidationError, match=f"the custom loss is {bad}, not finite") as error:
        client.forward_backward_custom(policy_datums(2), poisoned).result()
    assert error.value.code == "validation.non_finite_custom_loss"
    assert gradients(client) == [None] * len(client._parameters)


def test_a_custom_loss_with_a_non_finite_gradient_is_rejected_before_any_gradient(service):
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)

    def sqrt_at_zero(data, logprobs):  # finite (0), but d sqrt(x)/dx at 0 is inf: 0·inf = NaN
        return sum(torch.sqrt(lp * 0.0).sum() for lp in logprobs), {}

    with pytest.raises(ValidationError, match="datum 0, position 0 is nan") as error:
        client.forward_backward_custom(policy_datums(2), sqrt_at_zero).result()
    assert error.value.code == "validation.non_finite_custom_loss_gradient"
    assert gradients(client) == [None] * len(client._parameters)


def test_a_builtin_loss_that_overflows_is_rejected_before_any_gradient(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    client.forward_backward(datums[:1], "importance_sampling").result()
    accumulated = gradients(client)
    # Finite inputs, but r = exp(lp − (−200)) overflows float32: an infinite loss.
    overflowing = []
    for datum in datums:
        trained = np.asarray(datum.loss_fn_inputs["advantages"].data) != 0
        sampling_logprobs = np.where(trained, -200.0, 0.0).astype(np.float32)
        overflowing.append(_with_input(datum, "logprobs", sampling_logprobs))
    refused = (
        r"importance_sampling loss is (nan|-?inf) on finite inputs; "
        r"its largest log-ratio lp − lp_old is 1\d\d(\.\d+)? \(datum \d, position \d+\)"
    )
    with pytest.raises(ValidationError, match=refused) as error:
        client.forward_backward(overflowing, "importance_sampling").result()
    assert error.value.code == "validation.non_finite_loss"
    after = gradients(client)  # the earlier call's gradients, untouched
    assert all(torch.equal(a, b) for a, b in zip(accumulated, after, strict=True) if a is not None)
    assert [g is None for g in accumulated] == [g is None for g in after]


def test_optim_step_refuses_a_non_finite_gradient_norm_and_changes_nothing(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    train(client, datums, steps=1, loss="importance_sampling")
    weights, state = lora_state(client), optimizer_state(client)
    client.forward_backward(datums, "importance_sampling").result()
    parameter = client._parameters[0]
    service._engine.run(lambda: parameter.grad.view(-1)[0].fill_(float("nan")))
    refused = "optimizer step 2 refused: the gradient norm is nan"
    with pytest.raises(ValidationError, match=refused) as error:
        client.optim_step(ADAM).result()
    assert error.value.code == "validation.non_finite_gradient"
    assert all(torch.equal(weights[key], value) for key, value in lora_state(client).items())
    assert _same_state(state, optimizer_state(client))
    assert client._optimizer_steps == 1
    assert gradients(client) == [None] * len(client._parameters)  # dropped: the next step is clean
    train(client, datums, steps=1, loss="importance_sampling")
    assert client.optim_step(ADAM).result().metrics["optimizer_step"] == 3.0


def test_save_state_refuses_non_finite_weights_and_keeps_the_last_checkpoint(service):
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    train(client, datums, steps=1)
    good = client.save_state("latest").result()
    parameter = client._parameters[0]
    service._engine.run(lambda: parameter.data.view(-1)[0].fill_(float("nan")))
    refused = r"save_state\('latest'\) refused after optimizer step 1: LoRA tensor .* holds NaN"
    with pytest.raises(ValidationError, match=refused) as error:
        client.save_state("latest", overwrite=True).result()
    assert error.value.code == "validation.non_finite_weights"
    with pytest.raises(ValidationError) as error:
        client.save_state("other").result()
    assert error.value.code == "validation.non_finite_weights"
    directory = Path(good.path.removeprefix("local://"))
    assert [path.name for path in directory.parent.iterdir()] == ["latest"]
    restored = service.create_training_client_from_state_with_optimizer(good.path)
    assert all(torch.isfinite(value).all() for value in lora_state(restored).values())


def test_a_learning_rate_blowup_is_never_saved_and_stops_the_next_step(service):
    """lr 1e30 leaves finite weights of ~1e30 whose logits are NaN: save_state refuses them
    and the next forward_backward stops before any gradient, naming the datum and position."""
    datums = policy_datums(2)
    client = service.create_lora_training_client(MODEL, rank=4, seed=0)
    client.forward_backward(datums, "ppo").result()
    client.optim_step(AdamParams(learning_rate=1e30)).result()
    assert all(torch.isfinite(value).all() for value in lora_state(client).values())
    with pytest.raises(ValidationError, match="the model's log-probs under them are NaN") as error:
        client.save_state("blown").result()
    assert error.value.code == "validation.non_finite_weights"
    with pytest.raises(ValidationError, match="log-prob of datum 0, position 0 is nan") as error:
        client.forward_backward(datums, "ppo").result()
    assert error.value.code == "validation.non_finite_logprobs"
    assert gradients(client) == [None] * len(client._parameters)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_a_damaged_grpo_local_json_is_an_error_naming_the_file_and_the_fix(
    tmp_path: Path, text: str
) -> None:
    from pytrio.errors.base import ValidationError

    from grpo.backends.local.checkpoint import METADATA_FILE, read_metadata

    (tmp_path / METADATA_FILE).write_text(text)
    with pytest.raises(ValidationError, match=f"{METADATA_FILE} (is damaged|holds list).*backup"):
        read_metadata(tmp_path)
