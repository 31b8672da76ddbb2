"""`/v1/completions` answers evaluation harnesses' log-likelihood requests exactly.

lm-eval 0.4.x's ``local-completions`` (``lm_eval/models/openai_completions.py``, read from its
0.4.13 wheel) sends, for ``loglikelihood`` and for each window of ``loglikelihood_rolling``,
``{"model", "prompt": [[token ids], ...], "temperature": 0, "max_tokens": 1, "logprobs": 1,
"seed": 1234, "echo": true}`` (a batch of context + continuation ids) and scores a choice as
``sum(token_logprobs[ctxlen:-1])``, greedy when each of those equals the largest of its
``top_logprobs``: the last entry is the token the request generated. Older harnesses (lm-eval
0.3's ``gpt3``, HELM-style scorers) send a text prompt with ``max_tokens: 0`` and sum
``token_logprobs[ctxlen:]``. Both sums must equal ``compute_logprobs`` on the same tokens (to
`LOGPROB_ATOL` a token: the server scores in other batches than the embedded backend), also
when the generated token is the end-of-turn token, which the server charges in ``usage`` and
so must report: one log-prob for every token charged.

Such a harness loads the tokenizer by the model's name before its first request
(``AutoTokenizer.from_pretrained``): a fresh server holds every served tokenizer, under its
name and its aliases, in the hub cache it prints (``HF_HUB_CACHE``) from the start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pytrio import ModelInput, SamplingParams

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME
from grpo.serve.compat import HUB_CACHE_DIRECTORY, hub_cache_exports
from tests.invariance import LOGPROB_ATOL
from tests.serve.conftest import SERVE_API_KEY

LM_EVAL_SEED = 1234
QUESTIONS = ("What is 2 + 3?", "12+34", "Compute 7*8.")
PAIRS = (("12+34=", "46"), ("Question: What is 2 + 3?\nAnswer:", " 5"), ("7*8", "=56."))


def _post(served: Any, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{served.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {SERVE_API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _lm_eval_payload(prompts: list[list[int]]) -> dict[str, Any]:
    """What lm-eval 0.4.x's LocalCompletionsAPI._create_payload(generate=False) sends."""
    return {
        "model": TINY_MODEL_NAME,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": LM_EVAL_SEED,
        "echo": True,
    }


def _lm_eval_scores(reply: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.x's LocalCompletionsAPI.parse_logprobs: (log-likelihood, is_greedy)."""
    scores = []
    choices = sorted(reply["choices"], key=lambda choice: choice["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(value == max(top.values()) for value, top in zip(values, tops, strict=True))
        scores.append((sum(values), greedy))
    return scores


def _rolling_windows(tokens: list[int], prefix: int, max_seq_len: int) -> list[tuple[list, list]]:
    """lm-eval's get_rolling_token_windows(context_len=1) made disjoint (make_disjoint_window)."""
    windows = []
    first = min(max_seq_len, len(tokens))
    windows.append(([prefix, *tokens[: first - 1]], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        length = min(len(tokens) - predicted, max_seq_len)
        end = predicted + length
        windows.append((tokens[end - max_seq_len - 1 : end - 1], tokens[end - length : end]))
        predicted += length
    return [(context[: len(context) - (len(target) - 1)], target) for context, target in windows]


@pytest.fixture
def embedded(tmp_path: Path) -> Any:
    """The embedded local backend's sampler of the built-in model (the reference)."""
    with LocalServiceClient(root=tmp_path / "embedded") as service:
        yield service.create_sampling_client(TINY_MODEL_NAME)


def _logprobs(sampler: Any, tokens: list[int]) -> list[float]:
    return sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()


def _ends_a_turn(sampler: Any) -> list[int]:
    """A chat prompt plus its greedy reply up to (not including) the end-of-turn token that
    greedy decoding writes next."""
    tokenizer = sampler.get_tokenizer()
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=64, temperature=0.0, seed=0)
        (sequence,) = sampler.sample(ModelInput.from_ints(prompt), 1, params).result().sequences
        if sequence.tokens and sequence.tokens[-1] in sampler.end_token_ids:
            return prompt + list(sequence.tokens[:-1])
    raise AssertionError(f"no greedy reply to {QUESTIONS} ends its turn within 64 tokens")


def test_lm_eval_loglikelihood_sums_are_exact_when_the_generated_token_ends_the_turn(
    served: Any, embedded: Any
) -> None:
    tokenizer = embedded.get_tokenizer()
    end_of_turn = tokenizer.decode(sorted(embedded.end_token_ids)[:1])
    # lm-eval's _encode_pair: the whole string encoded, the context's tokens split off.
    requests = []
    for context, continuation in PAIRS:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        ctxlen = len(tokenizer.encode(context, add_special_tokens=False))
        requests.append((whole, ctxlen))
    turn = _ends_a_turn(embedded)  # a continuation after which greedy decoding ends the turn
    requests.append((turn, len(turn) - 3))
    prompts, ctxlens = [ids for ids, _ in requests], [ctxlen for _, ctxlen in requests]
    reply = _post(served, _lm_eval_payload(prompts))
    assert reply["usage"]["completion_tokens"] == len(prompts)  # one token each, charged
    for choice, ids in zip(reply["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        # One entry for every token charged: the prompt's, then the generated one.
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert len(logprobs[field]) == len(ids) + 1, field
    last = reply["choices"][-1]["logprobs"]
    assert last["tokens"][-1] == end_of_turn and reply["choices"][-1]["finish_reason"] == "stop"
    eot_logprob = _logprobs(embedded, [*turn, *sorted(embedded.end_token_ids)[:1]])[-1]
    assert last["token_logprobs"][-1] == pytest.approx(eot_logprob, abs=LOGPROB_ATOL)
    assert last["top_logprobs"][-1] == {end_of_turn: pytest.approx(eot_logprob, abs=LOGPROB_ATOL)}
    for (score, greedy), (ids, ctxlen) in zip(_lm_eval_scores(reply, ctxlens), requests):
        expected = _logprobs(embedded, ids)[ctxlen:]
        tolerance = LOGPROB_ATOL * len(expected)
        assert score == pytest.approx(sum(expected), abs=tolerance), (ids, ctxlen)
        assert isinstance(greedy, bool)
    # The turn's continuation is greedy decoding's own output: lm-eval must call it greedy.
    assert _lm_eval_scores(reply, ctxlens)[-1][1] is True


def test_lm_eval_loglikelihood_rolling_windows_sum_to_compute_logprobs(
    served: Any, embedded: Any
) -> None:
    tokenizer = embedded.get_tokenizer()
    text = "12+34=46. What is 2 + 3? The answer is \\boxed{5}. 7*8=56 and 9-4=5."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    windows = _rolling_windows(tokens, tokenizer.eos_token_id, max_seq_len=8)
    assert len(windows) >= 3
    prompts = [context + target for context, target in windows]
    ctxlens = [len(context) for context, _ in windows]
    reply = _post(served, _lm_eval_payload(prompts))
    total = sum(score for score, _ in _lm_eval_scores(reply, ctxlens))
    expected = sum(
        sum(_logprobs(embedded, prompt)[ctxlen:])
        for prompt, ctxlen in zip(prompts, ctxlens, strict=True)
    )
    assert total == pytest.approx(expected, abs=LOGPROB_ATOL * len(tokens))
    assert sum(len(target) for _, target in windows) == len(tokens)  # every token scored once


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_text_prompts_with_echo_score_every_token_charged(
    served: Any, embedded: Any, max_tokens: int
) -> None:
    """Older harnesses' request (a text prompt, ``max_tokens: 0``: the prompt scored only)
    and lm-eval's ``max_tokens: 1`` on text: the sum over the continuation is exact."""
    tokenizer = embedded.get_tokenizer()
    prompts = [context + continuation for context, continuation in PAIRS]
    reply = _post(
        served,
        {"model": TINY_MODEL_NAME, "prompt": prompts, "max_tokens": max_tokens, "logprobs": 1}
        | {"echo": True, "temperature": 0},
    )
    assert reply["usage"]["completion_tokens"] == max_tokens * len(prompts)
    for choice, (context, continuation) in zip(reply["choices"], PAIRS, strict=True):
        ids = tokenizer.encode(context + continuation, add_special_tokens=False)
        ctxlen = len(tokenizer.encode(context, add_special_tokens=False))
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(ids) + max_tokens and values[0] is None
        expected = _logprobs(embedded, ids)
        assert values[1 : len(ids)] == pytest.approx(expected[1:], abs=LOGPROB_ATOL)
        scored = values[ctxlen : len(ids)]
        assert sum(scored) == pytest.approx(sum(expected[ctxlen:]), abs=LOGPROB_ATOL * len(ids))


@pytest.mark.parametrize("echo", [True, False])
def test_every_completion_token_charged_has_its_logprob(
    served: Any, embedded: Any, echo: bool
) -> None:
    """Sampled completions of chat prompts (many end their turn): the log-probs list holds
    the prompt (with echo) and every generated token, the end-of-turn token included, each
    equal to compute_logprobs on the same tokens."""
    tokenizer = embedded.get_tokenizer()
    end_ids = sorted(embedded.end_token_ids)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for question in QUESTIONS
    ]
    ended = 0
    for seed, prompt in enumerate(prompts):
        body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 40, "logprobs": 2}
        reply = _post(served, body | {"echo": echo, "seed": seed, "temperature": 1.0})
        (choice,) = reply["choices"]
        logprobs = choice["logprobs"]
        charged = reply["usage"]["completion_tokens"]
        shown = len(prompt) if echo else 0
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert len(logprobs[field]) == shown + charged, field
        # The same seed on the embedded backend samples the same tokens (tests/invariance.py).
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed)
        (sequence,) = embedded.sample(ModelInput.from_ints(prompt), 1, params).result().sequences
        assert len(sequence.tokens) == charged
        expected = _logprobs(embedded, prompt + list(sequence.tokens))[len(prompt) :]
        assert logprobs["token_logprobs"][shown:] == pytest.approx(expected, abs=LOGPROB_ATOL)
        assert logprobs["tokens"][shown:] == [tokenizer.decode([t]) for t in sequence.tokens]
        if sequence.tokens[-1] in end_ids:
            ended += 1
            assert choice["finish_reason"] == "stop"
            assert not choice["text"].endswith(tokenizer.decode(end_ids[:1]))
    assert ended > 0  # the end-of-turn case is exercised


LOAD_BY_NAME = """
import json, sys
from transformers import AutoTokenizer
loaded = {}
for name in sys.argv[2:]:
    tokenizer = AutoTokenizer.from_pretrained(name)
    loaded[name] = [tokenizer.get_vocab(), tokenizer.encode(sys.argv[1]), tokenizer.chat_template]
print(json.dumps(loaded))
"""


def test_a_fresh_server_holds_every_served_tokenizer_in_its_hub_cache_before_any_request(
    tmp_path: Path,
) -> None:
    """lm-eval's local-completions loads AutoTokenizer by the model's name, offline, before
    its first request: every served model, under its name and each alias, is there."""
    from grpo.serve.server import serve_in_thread

    alias = "Qwen/Qwen3.5-4B"
    text = "What is 2 + 3? \\boxed{5}<|im_end|>"
    with serve_in_thread(
        root=tmp_path / "served", api_key=SERVE_API_KEY, aliases={alias: TINY_MODEL_NAME}
    ) as handle:
        # What `grpo serve` prints: the lines are written after the server has started.
        printed = hub_cache_exports(handle.state.registry.root / HUB_CACHE_DIRECTORY)
        hub = next(line.split("=", 1)[1] for line in printed if "HF_HUB_CACHE=" in line)
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("HF_", "TRANSFORMERS_", "MODELSCOPE_"))
        }
        env |= {
            "HOME": str(tmp_path / "home"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_CACHE": hub,
        }
        names = [TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME, alias]
        done = subprocess.run(
            [sys.executable, "-c", LOAD_BY_NAME, text, *names],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        loaded = json.loads(done.stdout.splitlines()[-1])
    with LocalServiceClient(root=tmp_path / "embedded") as service:
        for name in names:
            served = TINY_MODEL_NAME if name == alias else name
            tokenizer = service.create_sampling_client(served).get_tokenizer()
            vocab, ids, template = loaded[name]
            assert vocab == tokenizer.get_vocab(), name
            assert ids == tokenizer.encode(text) and template == tokenizer.chat_template, name
