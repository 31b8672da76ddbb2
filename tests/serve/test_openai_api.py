"""`grpo serve`'s OpenAI-compatible API through the official ``openai`` client: a trained
checkpoint answers chat and completion requests with its own log-probs; seeds, ``n``, stop
strings, echo scoring; bounds and errors in OpenAI's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import pytrio
from pytrio import AdamParams, Datum, ModelInput, SamplingParams

from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.serve.openai_wire import MAX_MESSAGES, MAX_STOP, parse_chat, parse_completion
from grpo.serve.wire import ServeError
from tests.serve.conftest import SERVE_API_KEY

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _client(served: Any, key: str = SERVE_API_KEY) -> Any:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=120)


def _trained_weights() -> tuple[str, Any]:
    """A checkpoint trained a few cross-entropy steps toward a reply: its sampler path, and
    the base model's tokenizer."""
    trainer = pytrio.ServiceClient().create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    tokenizer = trainer.get_tokenizer()
    ids = tokenizer.encode("<|im_start|>assistant\n5<|im_end|>", add_special_tokens=False)
    datum = Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64)},
    )
    for _ in range(3):
        trainer.forward_backward([datum], loss_fn="cross_entropy").result()
        trainer.optim_step(AdamParams(learning_rate=5e-2)).result()
    return trainer.save_weights_for_sampler(name="openai-checkpoint").result().path, tokenizer


def test_chat_answers_from_a_trained_checkpoint_with_its_logprobs(served: Any) -> None:
    path, tokenizer = _trained_weights()
    reply = _client(served).chat.completions.create(
        model=path, messages=QUESTION, logprobs=True, top_logprobs=2, max_tokens=6, seed=0
    )
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    (choice,) = reply.choices
    content = choice.logprobs.content
    assert choice.message.role == "assistant" and reply.model == path
    assert "".join(item.token for item in content) == choice.message.content
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.logprob - 1e-9 for item in content)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens >= len(content) > 0
    # The same seed on pytrio's sampler of the checkpoint: the same tokens, and the reported
    # numbers are that checkpoint's log-probs, not the base model's.
    service = pytrio.ServiceClient()
    trained = service.create_sampling_client(TINY_MODEL_NAME, model_path=path)
    params = SamplingParams(max_tokens=6, seed=0)
    (sequence,) = trained.sample(ModelInput.from_ints(prompt_ids), 1, params).result().sequences
    tokens = [t for t in sequence.tokens if t != tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert [tokenizer.decode([t]) for t in tokens] == [item.token for item in content]
    ids = ModelInput.from_ints(prompt_ids + tokens)
    expected = trained.compute_logprobs(ids).result()[len(prompt_ids) :]
    assert [item.logprob for item in content] == pytest.approx(expected, abs=1e-5)
    base = service.create_sampling_client(TINY_MODEL_NAME).compute_logprobs(ids).result()
    assert not np.allclose(base[len(prompt_ids) :], expected, atol=1e-3)


def test_completions_echo_scores_the_prompt_as_compute_logprobs_does(served: Any) -> None:
    """Older harnesses' log-likelihood request: ``max_tokens=0, echo=True, logprobs=1``
    (lm-eval 0.4's ``max_tokens=1`` one: tests/serve/test_openai_harness.py)."""
    prompts = ["12+34=46", [5, 6, 7, 8]]
    reply = _client(served).completions.create(
        model=TINY_MODEL_NAME, prompt=prompts, max_tokens=0, echo=True, logprobs=1, n=2
    )
    sampler = pytrio.ServiceClient().create_sampling_client(TINY_MODEL_NAME)
    tokenizer = sampler.get_tokenizer()
    ids = [tokenizer.encode(prompts[0], add_special_tokens=False), prompts[1]]
    assert len(reply.choices) == 4 and [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert reply.usage.completion_tokens == 0
    for choice, tokens in zip(reply.choices, [ids[0], ids[0], ids[1], ids[1]], strict=True):
        expected = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
        assert choice.text == tokenizer.decode(tokens) and choice.finish_reason == "length"
        assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    assert reply.choices[0].text == prompts[0]


def test_a_seed_reproduces_the_choices_and_n_gives_n_of_them(served: Any) -> None:
    client = _client(served)

    def texts(seed: int) -> list[str]:
        reply = client.completions.create(
            model=TINY_MODEL_NAME, prompt="What is 7 + 8?", n=3, seed=seed, max_tokens=12
        )
        assert reply.usage.completion_tokens > 0
        return [choice.text for choice in reply.choices]

    first = texts(1)
    assert len(first) == 3 and texts(1) == first
    assert texts(2) != first


def test_the_text_ends_before_the_first_stop_string(served: Any) -> None:
    client = _client(served)
    common = {"model": TINY_MODEL_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    free = client.chat.completions.create(**common).choices[0].message.content
    stop = free[2:4]
    assert len(stop) == 2, free
    stopped = client.chat.completions.create(**common, stop=[stop, "@@"]).choices[0]
    assert stopped.message.content == free[: free.find(stop)]
    assert stopped.finish_reason == "stop"


def test_refusals_are_openai_errors_naming_the_field(served: Any) -> None:
    client = _client(served)
    with pytest.raises(openai.NotFoundError, match="no-such-model.*save_weights_for_sampler"):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError, match="--api-key"):
        _client(served, key="wrong").chat.completions.create(
            model=TINY_MODEL_NAME, messages=QUESTION
        )
    cases = [
        ({"extra_body": {"best_guess": 1}}, r"unrecognized.*best_guess"),
        ({"stream": True}, "stream"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"n": 0}, r"n must be an integer in \[1, 128\]"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\]\.role"),
    ]
    for extra, message in cases:
        arguments = {"model": TINY_MODEL_NAME, "messages": QUESTION, **extra}
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(**arguments)
    request = urllib.request.Request(
        f"{served.url}/v1/completions",
        data=json.dumps({"model": TINY_MODEL_NAME, "prompt": ""}).encode(),
        headers={"Authorization": f"Bearer {SERVE_API_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    body = json.loads(raised.value.read())
    assert raised.value.code == 400
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "non-empty prompts" in body["error"]["message"]


def test_models_lists_the_served_models(served: Any) -> None:
    names = [model.id for model in _client(served).models.list()]
    assert TINY_MODEL_NAME in names


# --- requests, checked before anything runs -------------------------------------------------


def test_a_chat_request_is_bounded_before_it_is_rendered() -> None:
    base = {"model": TINY_MODEL_NAME}
    too_many = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    for body, message in [
        ({**base, "messages": too_many}, "messages must be a list of 1 to"),
        ({**base, "messages": QUESTION, "stop": ["a"] * (MAX_STOP + 1)}, "stop must be"),
        ({**base, "messages": [{"role": "user", "content": "x" * 2**21}]}, "characters"),
        ({**base, "messages": QUESTION, "seed": -1}, "seed must be"),
        ({**base, "messages": QUESTION, "response_format": {"type": "json_object"}}, "response"),
        (
            {"messages": QUESTION, "model": "x", "chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs",
        ),
        (
            {**base, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            r"content\[0\] is a 'image_url' part",
        ),
    ]:
        with pytest.raises(ServeError, match=message) as raised:
            parse_chat(body)
        assert raised.value.status == 400


def test_a_chat_request_reads_text_parts_and_the_developer_role() -> None:
    parsed = parse_chat(
        {
            "model": TINY_MODEL_NAME,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "2 + "}, {"type": "text", "text": "3?"}],
                },
            ],
            "logprobs": True,
            "max_completion_tokens": 7,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert [m["role"] for m in parsed.messages] == ["system", "user"]
    assert parsed.messages[1]["content"] == "2 + 3?"
    assert parsed.generation.max_tokens == 7 and parsed.generation.top_logprobs == 0
    assert parsed.template_kwargs == {"enable_thinking": False}


def test_a_completion_request_takes_every_prompt_form_openai_does() -> None:
    for prompt, expected in [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2], ((1, 2),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
    ]:
        assert parse_completion({"model": "m", "prompt": prompt}).prompts == expected
    for prompt in [None, [], [[]], [1.5], {"text": "hi"}]:
        with pytest.raises(ServeError, match="prompt"):
            parse_completion({"model": "m", "prompt": prompt})
    assert parse_completion({"model": "m", "prompt": "x"}).generation.max_tokens == 16


def test_weights_saved_again_under_the_same_path_are_the_ones_answered(served: Any) -> None:
    """A sampler checkpoint is overwritten on each save: the server's kept sampler reloads."""
    trainer = pytrio.ServiceClient().create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    ids = trainer.get_tokenizer().encode("12+34=46", add_special_tokens=False)
    datum = Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64)},
    )
    client, answered, expected = _client(served), [], []
    for _ in range(2):
        trainer.forward_backward([datum], loss_fn="cross_entropy").result()
        trainer.optim_step(AdamParams(learning_rate=5e-2)).result()
        path = trainer.save_weights_for_sampler(name="resaved").result().path
        reply = client.completions.create(
            model=path, prompt=ids, max_tokens=0, echo=True, logprobs=0
        )
        answered.append(reply.choices[0].logprobs.token_logprobs[1:])
        sampler = trainer.create_sampling_client(path)
        expected.append(sampler.compute_logprobs(ModelInput.from_ints(ids)).result()[1:])
    assert answered[0] == pytest.approx(expected[0], abs=1e-5)
    assert answered[1] == pytest.approx(expected[1], abs=1e-5)
    assert not np.allclose(answered[0], answered[1], atol=1e-4)
