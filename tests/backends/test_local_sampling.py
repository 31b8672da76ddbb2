"""The local backend's sampler: log-probs, seeds, batching, filters, stops, validation.

Runs on a randomly initialised tiny model (`init_tiny_model(0)`), so results do not
depend on the shipped warm-started weights; an independent copy of that model is the
oracle for logits.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from pytrio.errors.base import ValidationError
from pytrio.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

import grpo.backends.local.sampling_client as sampling_client
from grpo.backends.local import LocalServiceClient, tiny
from grpo.backends.local.sampler import attention
from tests.invariance import assert_same_samples

MODEL = tiny.TINY_MODEL_NAME


@pytest.fixture(autouse=True)
def random_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny, "load_tiny_model", lambda *_: tiny.init_tiny_model(0))


@pytest.fixture(params=["padded", "row-dependent"])
def any_blas(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test as shipped, and with matmuls whose rounding depends on the batch's row count.

    The sampler pads every call to ``ROW_MULTIPLE`` rows, which on some CPUs makes each row's
    float32 matmul independent of its batch; MKL on an Intel AVX-512 CPU still rounds rows
    differently by row count. With no padding (``ROW_MULTIPLE = 1``) most CPUs do the same,
    so the sampler's guarantee (tests/invariance.py) is checked on that path everywhere.
    """
    if request.param == "row-dependent":
        monkeypatch.setattr(attention, "ROW_MULTIPLE", 1)
    return request.param


def test_cpu_capability_is_the_forced_one() -> None:
    """Under tests/backends/test_cpu_paths.py the ATen path really is the one it forces."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced is None:
        pytest.skip("no ATEN_CPU_CAPABILITY set: the CPU's own path")
    assert torch.backends.cpu.get_cpu_capability().lower() == forced


@pytest.fixture
def service(tmp_path) -> LocalServiceClient:
    with LocalServiceClient(root=tmp_path, seed=0) as client:
        yield client


def prompt_tokens(length: int, seed: int) -> list[int]:
    """A prompt of printable characters (ids past the specials; no <|im_end|>)."""
    return np.random.default_rng(seed).integers(4, len(tiny.build_tokenizer()), length).tolist()


def params(seed: int | None = None, max_tokens: int = 12, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, **kwargs)


def as_datum(prompt: list[int], completion: list[int]) -> Datum:
    tokens = prompt + completion
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))
        },
    )


def trained_client(service: LocalServiceClient, steps: int = 2):
    """A training client whose LoRA has moved away from zero (so it changes the outputs)."""
    client = service.create_lora_training_client(MODEL, rank=8, seed=1)
    datum = as_datum(prompt_tokens(20, 1), prompt_tokens(10, 2))
    for _ in range(steps):
        client.forward_backward([datum]).result()
        client.optim_step(AdamParams(learning_rate=3e-2)).result()
    return client


def oracle_logits(tokens: list[int]) -> torch.Tensor:
    """Next-token logits at every position, from an independent copy of the base model."""
    model, _ = tiny.init_tiny_model(0)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].double()


def test_sampled_logprobs_match_training_forward_at_temperature_one(service):
    client = trained_client(service)
    sampler = client.save_weights_and_get_sampling_client()
    prompt = prompt_tokens(30, 3)
    response = sampler.sample(
        ModelInput.from_ints(prompt), num_samples=6, sampling_params=params(5, 16)
    ).result()
    datums = [as_datum(prompt, sequence.tokens) for sequence in response.sequences]
    forward = client.forward(datums).result()
    for sequence, output in zip(response.sequences, forward.loss_fn_outputs, strict=True):
        trained = np.asarray(output["logprobs"].data)[len(prompt) - 1 :]
        np.testing.assert_allclose(sequence.logprobs, trained, atol=1e-4)
        assert len(sequence.logprobs) == len(sequence.tokens)


def test_logprobs_stay_exact_when_finished_rows_leave_the_batch(service, any_blas):
    client = trained_client(service, steps=1)
    sampler = client.save_weights_and_get_sampling_client()
    prompt = prompt_tokens(21, 30)
    # A tenth of the vocabulary stops a sequence, so rows finish at scattered steps and the batch
    # is compacted several times.
    sampling = params(3, 24, stop=list(range(4, 14)))
    response = sampler.sample(ModelInput.from_ints(prompt), 40, sampling).result()
    lengths = [len(sequence.tokens) for sequence in response.sequences]
    assert min(lengths) < 4 and max(lengths) > 12
    forward = client.forward(
        [as_datum(prompt, sequence.tokens) for sequence in response.sequences]
    ).result()
    for sequence, output in zip(response.sequences, forward.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            sequence.logprobs, output["logprobs"].data[len(prompt) - 1 :], atol=1e-4
        )
    few = sampler.sample(ModelInput.from_ints(prompt), 2, sampling).result()
    assert_same_samples(few.sequences, response.sequences[:2])


def test_rows_of_other_prompt_lengths_keep_their_own_cache_when_the_batch_shrinks(service):
    """Finished rows leave the decode batch by moving active rows from its end into freed
    slots (``DecodeCache.compact``): a moved row must take its keys, values and mask along.
    Rows are sorted by prompt length, so the movers are the long prompt's rows and the
    slots they land in held the short prompt's, whose mask hides 20 more positions."""
    client = trained_client(service, steps=1)
    sampler = client.save_weights_and_get_sampling_client()
    short, long = prompt_tokens(9, 31), prompt_tokens(30, 32)
    sampling = params(5, 24, stop=list(range(4, 40)))  # rows stop at scattered steps
    gate = threading.Event()
    held = sampler._engine.worker.call(lambda: gate.wait(30))
    futures = [
        sampler.sample(ModelInput.from_ints(prompt), 24, sampling) for prompt in (short, long)
    ]
    gate.set()
    assert held.result() is True
    for prompt, future in zip((short, long), futures, strict=True):
        sequences = future.result().sequences
        lengths = [len(sequence.tokens) for sequence in sequences]
        assert min(lengths) < 4 and max(lengths) > 12
        forward = client.forward([as_datum(prompt, seq.tokens) for seq in sequences]).result()
        for sequence, output in zip(sequences, forward.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                sequence.logprobs, output["logprobs"].data[len(prompt) - 1 :], atol=1e-4
            )


def test_the_one_call_decode_samples_what_the_span_by_span_decode_samples(service, any_blas):
    """``decode.decode_logits`` (every row in one attention call, a -inf bias before each
    row's prompt) against the span-by-span decode through the prefill's cache, on a batch
    of five prompt lengths (four spans) whose rows stop at scattered steps."""
    client = trained_client(service, steps=1)
    sampler = client.save_weights_and_get_sampling_client()
    prompts = [ModelInput.from_ints(prompt_tokens(n, 40 + n)) for n in (5, 9, 17, 30, 41)]
    sampling = params(8, 20, stop=list(range(4, 40)))

    def sample_all() -> list[object]:
        gate = threading.Event()
        held = sampler._engine.worker.call(lambda: gate.wait(30))
        futures = [sampler.sample(prompt, 6, sampling) for prompt in prompts]
        gate.set()
        assert held.result() is True
        return [future.result() for future in futures]

    one_call = sample_all()
    client._host.one_call_decode = False
    span_by_span = sample_all()
    lengths = [len(seq.tokens) for response in one_call for seq in response.sequences]
    assert min(lengths) < 4 and max(lengths) > 12  # the batch shrank as rows finished
    assert_same_samples(one_call, span_by_span)


@pytest.mark.parametrize("threads", [1, 3])
def test_seeded_request_is_identical_alone_and_batched_with_others(
    service, monkeypatch, threads, any_blas
):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # several threads split matmuls and attention differently
    try:
        _check_batch_invariance(service, monkeypatch)
    finally:
        torch.set_num_threads(previous)


def _check_batch_invariance(service, monkeypatch) -> None:
    batch_sizes: list[list[int]] = []
    run_batch = sampling_client.sample_batch

    def recording(host, weights, pending, **options):
        batch_sizes.append([item.spec.num_samples for item in pending])
        return run_batch(host, weights, pending, **options)

    monkeypatch.setattr(sampling_client, "sample_batch", recording)
    sampler = trained_client(service, steps=1).save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(prompt_tokens(40, 4))
    alone = sampler.sample(prompt, 3, params(7), include_prompt_logprobs=True).result()
    other = ModelInput.from_ints(prompt_tokens(70, 5))
    other_alone = sampler.compute_logprobs(other).result()
    # Hold the worker while the four requests queue, so they form one batch however slowly
    # this thread submits them (a loaded machine can outlast the coalescing window).
    gate = threading.Event()
    held = sampler._engine.worker.call(lambda: gate.wait(30))
    futures = [
        sampler.sample(other, num_samples=5, sampling_params=params(1, 20)),
        sampler.sample(prompt, 3, params(7), include_prompt_logprobs=True),
        sampler.sample(
            ModelInput.from_ints(prompt_tokens(9, 6)), num_samples=2, sampling_params=params(2, 4)
        ),
        sampler.compute_logprobs(other),
    ]
    gate.set()
    assert held.result() is True
    batched = futures[1].result()
    assert [len(sizes) for sizes in batch_sizes] == [1, 1, 4]  # really batched together
    assert_same_samples(batched, alone)  # tokens exactly; log-probs to a stated tolerance
    assert_same_samples(futures[3].result(), other_alone)
    assert all(future.result() for future in futures)


def test_same_seed_same_samples_and_other_seed_differs(service):
    sampler = service.create_sampling_client(MODEL)
    prompt = ModelInput.from_ints(prompt_tokens(25, 7))
    first = sampler.sample(prompt, num_samples=4, sampling_params=params(11)).result()
    again = sampler.sample(prompt, num_samples=4, sampling_params=params(11)).result()
    other = sampler.sample(prompt, num_samples=4, sampling_params=params(12)).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1  # each sample has its own stream


def test_unseeded_requests_follow_the_service_seed(tmp_path):
    def draws(seed: int) -> list[list[int]]:
        with LocalServiceClient(root=tmp_path, seed=seed) as service:
            sampler = service.create_sampling_client(MODEL)
            prompt = ModelInput.from_ints(prompt_tokens(15, 8))
            return [
                s.tokens
                for _ in range(2)
                for s in sampler.sample(prompt, 2, params(None, 6)).result().sequences
            ]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_greedy_follows_the_argmax_with_logprob_zero(service):
    sampler = service.create_sampling_client(MODEL)
    prompt = prompt_tokens(20, 9)
    greedy = sampler.sample(
        ModelInput.from_ints(prompt), 2, params(None, 8, temperature=0.0)
    ).result()
    tokens = greedy.sequences[0].tokens
    logits = oracle_logits(prompt + tokens)
    end = tiny.build_tokenizer().convert_tokens_to_ids(tiny.IM_END)
    expected = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert tokens == expected[: len(tokens)]
    assert len(tokens) == 8 or tokens[-1] == end
    assert greedy.sequences[0].logprobs == [0.0] * len(tokens)
    assert greedy.sequences[1].tokens == tokens
    top1 = sampler.sample(ModelInput.from_ints(prompt), 1, params(3, 8, top_k=1)).result()
    assert top1.sequences[0].tokens == tokens
    assert top1.sequences[0].logprobs == pytest.approx([0.0] * len(tokens), abs=1e-12)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 5, 1.0), (1.3, -1, 0.5), (1.0, 10, 0.3)]
)
def test_logprobs_are_those_of_the_filtered_renormalised_distribution(
    service, temperature, top_k, top_p
):
    sampler = service.create_sampling_client(MODEL)
    prompt = prompt_tokens(12, 10)
    sampling = params(21, 10, temperature=temperature, top_k=top_k, top_p=top_p)
    for sequence in sampler.sample(ModelInput.from_ints(prompt), 3, sampling).result().sequences:
        logits = oracle_logits(prompt + sequence.tokens)[len(prompt) - 1 :]
        for step, (token, logprob) in enumerate(
            zip(sequence.tokens, sequence.logprobs, strict=True)
        ):
            logprobs = torch.log_softmax(logits[step] / temperature, -1)
            order = logprobs.argsort(descending=True)
            kept = order[: top_k if top_k > 0 else len(order)]
            head = torch.log_softmax(logprobs[kept], -1).exp()
            kept = kept[(head.cumsum(0) - head) < top_p]
            assert token in kept.tolist()
            expected = logprobs[token] - torch.logsumexp(logprobs[kept], 0)
            assert logprob == pytest.approx(float(expected), abs=1e-5)


def test_stop_reasons_tokens_and_text(service):
    tokenizer = tiny.build_tokenizer()
    end = tokenizer.convert_tokens_to_ids(tiny.IM_END)
    sampler = service.create_sampling_client(MODEL)
    prompt = ModelInput.from_ints(prompt_tokens(10, 11))
    response = sampler.sample(prompt, 48, params(4, 40)).result()
    reasons = {sequence.stop_reason for sequence in response.sequences}
    assert reasons == {"stop", "length"}  # a random model ends some turns (about 1 in 97 tokens)
    for sequence in response.sequences:
        if sequence.stop_reason == "stop":
            assert sequence.tokens[-1] == end and end not in sequence.tokens[:-1]
            assert sequence.text == tokenizer.decode(
                sequence.tokens[:-1], skip_special_tokens=False
            )
        else:
            assert len(sequence.tokens) == 40 and end not in sequence.tokens
            assert sequence.text == tokenizer.decode(sequence.tokens, skip_special_tokens=False)
    assert response.output_tokens == sum(len(s.tokens) for s in response.sequences)

    reference = sampler.sample(prompt, 1, params(4, 12)).result().sequences[0]
    stop_id = reference.tokens[5]
    first = reference.tokens.index(stop_id)
    by_id = sampler.sample(prompt, 1, params(4, 12, stop=[stop_id])).result().sequences[0]
    assert by_id.stop_reason == "stop" and by_id.tokens == reference.tokens[: first + 1]
    assert by_id.logprobs == reference.logprobs[: first + 1]

    stop_text = tokenizer.decode(reference.tokens[3:5])
    by_text = sampler.sample(prompt, 1, params(4, 12, stop=[stop_text])).result().sequences[0]
    assert by_text.stop_reason == "stop"
    assert stop_text in by_text.text and stop_text not in tokenizer.decode(by_text.tokens[:-1])
    assert by_text.tokens == reference.tokens[: len(by_text.tokens)]

    no_text = sampler.sample(prompt, 1, params(4, 12), return_text=False).result().sequences[0]
    assert no_text.text is None and no_text.tokens == reference.tokens


def test_prompt_logprobs_match_the_forward_and_start_with_none(service):
    client = trained_client(service, steps=1)
    sampler = client.save_weights_and_get_sampling_client()
    tokens = prompt_tokens(33, 12)
    response = sampler.sample(
        ModelInput.from_ints(tokens),
        1,
        params(1, 2),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    forward = client.forward([as_datum(tokens[:1], tokens[1:])]).result()
    expected = np.asarray(forward.loss_fn_outputs[0]["logprobs"].data)
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == len(tokens)
    np.testing.assert_allclose(response.prompt_logprobs[1:], expected, atol=1e-4)
    assert (
        sampler.compute_logprobs(ModelInput.from_ints(tokens)).result() == response.prompt_logprobs
    )
    assert response.topk_prompt_logprobs[0] is None
    for position, candidates in enumerate(response.topk_prompt_logprobs[1:]):
        values = [value for _, value in candidates]
        assert len(candidates) == 3 and values == sorted(values, reverse=True)
        assert values[0] >= response.prompt_logprobs[position + 1] - 1e-9
    plain = sampler.sample(ModelInput.from_ints(tokens), 1, params(1, 2)).result()
    assert plain.prompt_logprobs == [] and plain.topk_prompt_logprobs == []


def test_a_snapshot_sampler_keeps_sampling_the_old_weights(service):
    client = trained_client(service, steps=1)
    old = client.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(prompt_tokens(20, 13))
    before = old.sample(prompt, 4, params(8)).result()
    datum = as_datum(prompt_tokens(20, 14), prompt_tokens(12, 15))
    for _ in range(3):
        client.forward_backward([datum]).result()
        client.optim_step(AdamParams(learning_rate=5e-2)).result()
    after = old.sample(prompt, 4, params(8)).result()
    new_sampler = client.save_weights_and_get_sampling_client()
    new = new_sampler.sample(prompt, 4, params(8)).result()
    # Alternating samplers: each batch runs the merged step of its own weights.
    old_again = old.sample(prompt, 4, params(8)).result()
    new_again = new_sampler.sample(prompt, 4, params(8)).result()
    assert after == before == old_again
    assert new_again == new
    assert [s.logprobs for s in new.sequences] != [s.logprobs for s in before.sequences]
    datums = [as_datum(prompt.to_ints(), sequence.tokens) for sequence in new.sequences]
    forward = client.forward(datums).result()  # the trainer holds the new weights
    for sequence, output in zip(new.sequences, forward.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            sequence.logprobs, output["logprobs"].data[prompt.length - 1 :], atol=1e-4
        )


def test_saved_sampler_weights_sample_like_the_snapshot(service):
    client = trained_client(service, steps=1)
    saved = client.save_weights_for_sampler("w1").result()
    assert saved.path.startswith("local://") and saved.size > 0
    prompt = ModelInput.from_ints(prompt_tokens(18, 16))
    snapshot = client.save_weights_and_get_sampling_client().sample(prompt, 2, params(6)).result()
    from_path = client.create_sampling_client(saved.path).sample(prompt, 2, params(6)).result()
    from_service = (
        service.create_sampling_client(MODEL, model_path=saved.path)
        .sample(prompt, 2, params(6))
        .result()
    )
    assert from_path == snapshot == from_service


def test_threads_and_asyncio_get_the_same_results_as_sequential_calls(service, any_blas):
    sampler = service.create_sampling_client(MODEL)
    prompts = [
        ModelInput.from_ints(prompt_tokens(10 + 7 * index, 20 + index)) for index in range(4)
    ]
    sequential = [
        sampler.sample(prompt, 2, params(index)).result() for index, prompt in enumerate(prompts)
    ]
    threaded: list[object] = [None] * len(prompts)

    def run(index: int) -> None:
        threaded[index] = sampler.sample(prompts[index], 2, params(index)).result()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    async def gather() -> list[object]:
        return await asyncio.gather(
            *(
                sampler.sample_async(prompt, 2, params(index))
                for index, prompt in enumerate(prompts)
            ),
            sampler.compute_logprobs_async(prompts[0]),
        )

    *from_async, logprobs = asyncio.run(gather())
    assert_same_samples(threaded, sequential)
    assert_same_samples(from_async, sequential)
    assert logprobs[0] is None and len(logprobs) == len(prompts[0].to_ints())


@pytest.mark.parametrize(
    ("prompt", "kwargs", "code"),
    [
        ([], {}, "validation.empty_prompt"),
        ([5, 6], {"sampling_params": SamplingParams()}, "validation.invalid_sampling_request"),
        ([5, 6], {"num_samples": 0}, "validation.invalid_sampling_request"),
        ([5, 6], {"sampling_params": params(max_tokens=0)}, "validation.invalid_sampling_request"),
        (
            [5, 6],
            {"sampling_params": params(temperature=-0.1)},
            "validation.invalid_sampling_request",
        ),
        ([5, 6], {"sampling_params": params(top_p=0.0)}, "validation.invalid_sampling_request"),
        ([5, 6], {"sampling_params": params(top_p=1.5)}, "validation.invalid_sampling_request"),
        ([5, 6], {"sampling_params": params(top_k=0)}, "validation.invalid_sampling_request"),
        ([5, 6], {"sampling_params": params(stop=[""])}, "validation.invalid_sampling_request"),
        ([5, 6], {"sampling_params": params(stop=[10_000])}, "validation.invalid_sampling_request"),
        ([5, 6], {"topk_prompt_logprobs": -1}, "validation.invalid_sampling_request"),
        ([5, 10_000], {}, "validation.token_id_out_of_range"),
        ([5, -1], {}, "validation.token_id_out_of_range"),
        (
            [5] * 2045,
            {"sampling_params": params(max_tokens=7)},
            "validation.sampling_request_too_long",
        ),
    ],
)
def test_bad_sampling_requests_raise_before_any_work(service, prompt, kwargs, code):
    sampler = service.create_sampling_client(MODEL)
    arguments = {"num_samples": 1, "sampling_params": params(0), **kwargs}
    with pytest.raises(ValidationError) as error:
        sampler.sample(ModelInput.from_ints(prompt), **arguments)
    assert error.value.code == code


def test_compute_logprobs_rejects_an_empty_prompt(service):
    with pytest.raises(ValidationError) as error:
        service.create_sampling_client(MODEL).compute_logprobs(ModelInput.from_ints([]))
    assert error.value.code == "validation.empty_prompt"


def test_exiting_with_sampling_in_flight_exits_cleanly(tmp_path):
    script = f"""
from grpo.backends.local import tiny
tiny.load_tiny_model = lambda *_: tiny.init_tiny_model(0)
from grpo.backends.local import LocalServiceClient
from pytrio.types import ModelInput, SamplingParams
sampler = LocalServiceClient(root={str(tmp_path)!r}).create_sampling_client(tiny.TINY_MODEL_NAME)
futures = [sampler.sample(ModelInput.from_ints(list(range(5, 90))), 64,
                          SamplingParams(max_tokens=150))
           for _ in range(3)]
"""
    # A daemon thread still inside torch at interpreter teardown aborts the process (rc 134).
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr[-2000:]


def test_a_request_too_large_for_memory_is_refused_before_any_allocation(service):
    sampler = service.create_sampling_client(MODEL)
    with pytest.raises(
        ValidationError, match=r"sampling 1000000 x 10 positions needs about .* GiB"
    ):
        sampler.sample(
            ModelInput.from_ints([1, 2]),
            num_samples=10**6,
            sampling_params=SamplingParams(max_tokens=8),
        )


def test_merged_decode_step_agrees_with_the_hugging_face_forward(service, monkeypatch):
    from grpo.backends.local.sampler import loop

    sampler = trained_client(service).save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(prompt_tokens(33, 11))
    fast = sampler.sample(prompt, 4, params(3, 16), include_prompt_logprobs=True).result()
    # No merged step: prefill and decode run the Hugging Face forward with the adapter.
    unmerged: list[object] = []
    monkeypatch.setattr(loop, "_merged_step", lambda host, weights: unmerged.append(weights))
    slow = sampler.sample(prompt, 4, params(3, 16), include_prompt_logprobs=True).result()
    assert len(unmerged) == 1  # the batch really ran without the merged step
    np.testing.assert_allclose(fast.prompt_logprobs[1:], slow.prompt_logprobs[1:], atol=1e-5)
    for fast_sequence, slow_sequence in zip(fast.sequences, slow.sequences, strict=True):
        assert fast_sequence.tokens == slow_sequence.tokens
        np.testing.assert_allclose(fast_sequence.logprobs, slow_sequence.logprobs, atol=1e-5)


def test_unknown_architectures_decode_through_the_hugging_face_forward():
    from grpo.backends.local.sampler.merged import _DecodeStep

    model, _ = tiny.init_tiny_model(0)
    assert _DecodeStep.build(model) is not None
    model.config.hidden_act = "gelu"
    assert _DecodeStep.build(model) is None
