"""The OpenAI-compatible endpoints of `grpo serve`: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, on the same samplers, API key and bounds as the rest.

``model`` names a served model (its catalogue name or a ``--model-alias``) or sampler
weights: a ``save_weights_for_sampler`` path (``local://...``) or in-memory weights
(``memory://...``); `grpo.serve.registry.RunRegistry.sampler` finds the sampler. A chat is
rendered with the model's chat template (``add_generation_prompt``), a completion prompt is
taken as it is (text, encoded without special tokens, or token ids). Every prompt's ``n``
completions are one sample request of the local sampler; log-probs, when asked, come from one
scoring pass over prompt and completion: the model's distribution at temperature 1,
unfiltered, the same numbers whatever ``temperature`` sampled
the tokens. The text ends before the first ``stop`` string and before the end-of-turn token,
as OpenAI's does. Wire format and bounds: `grpo.serve.openai_wire`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import jinja2
from pytrio.types import ModelInput, SampleResponse, SamplingParams

from grpo.backends.local import LocalSamplingClient
from grpo.serve.endpoints import ServeState
from grpo.serve.messages import Reply, Request
from grpo.serve.openai_wire import (
    DEFAULT_CHAT_MAX_TOKENS,
    ChatRequest,
    Choice,
    Generation,
    TokenLogprob,
    chat_completion_body,
    completion_body,
    model_list_body,
    parse_chat,
    parse_completion,
)
from grpo.serve.wire import ServeError, local_call


def list_models(state: ServeState, request: Request) -> Reply:
    """``GET /v1/models``: the served models and their aliases."""
    return Reply(200, model_list_body(state.registry.catalogue.names()))


def chat_completions(state: ServeState, request: Request) -> Reply:
    """``POST /v1/chat/completions``: `n` replies to the messages, as ``chat.completion``."""
    chat = parse_chat(request.json())
    sampler = state.registry.sampler(chat.generation.model)
    tokenizer = sampler.get_tokenizer()
    prompt = tokenizer.encode(_render(tokenizer, chat), add_special_tokens=False)
    generation = chat.generation
    if generation.max_tokens is None:  # the default, within the positions the prompt leaves
        room = max(sampler.max_positions - len(prompt), 1)
        generation = attrs.evolve(generation, max_tokens=min(DEFAULT_CHAT_MAX_TOKENS, room))
    choices = _complete(sampler, [prompt], generation, echo=False, score_end=False)
    return Reply(200, chat_completion_body(chat.generation.model, choices, len(prompt)))


def completions(state: ServeState, request: Request) -> Reply:
    """``POST /v1/completions``: `n` completions of each prompt, as ``text_completion``."""
    completion = parse_completion(request.json())
    sampler = state.registry.sampler(completion.generation.model)
    tokenizer = sampler.get_tokenizer()
    prompts = [
        list(prompt) if isinstance(prompt, tuple) else _encode(tokenizer, prompt)
        for prompt in completion.prompts
    ]
    choices = _complete(
        sampler, prompts, completion.generation, echo=completion.echo, score_end=True
    )
    total = sum(len(prompt) for prompt in prompts)
    return Reply(200, completion_body(completion.generation.model, choices, total))


def _render(tokenizer: Any, chat: ChatRequest) -> str:
    """The chat as the model's template writes it, up to the assistant turn to generate."""
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(
            400,
            "invalid_request_error",
            f"model {chat.generation.model!r} has no chat template; send the prompt as text "
            "to /v1/completions",
        )
    try:
        return tokenizer.apply_chat_template(
            [dict(message) for message in chat.messages],
            tools=list(chat.tools) if chat.tools is not None else None,
            add_generation_prompt=True,
            tokenize=False,
            **chat.template_kwargs,
        )
    except (
        jinja2.TemplateError,  # the sandbox's SecurityError included
        ValueError,
        TypeError,
        LookupError,
        ArithmeticError,
        AttributeError,
    ) as error:  # the served model's own template, failing on what the client sent
        raise ServeError(
            400,
            "invalid_request_error",
            f"the chat template of {chat.generation.model!r} cannot render these messages: "
            f"{type(error).__name__}: {error}",
        ) from None


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ServeError(400, "invalid_request_error", "prompt encodes to no tokens")
    return ids


def _complete(
    sampler: LocalSamplingClient,
    prompts: Sequence[list[int]],
    generation: Generation,
    echo: bool,
    score_end: bool,
) -> list[Choice]:
    """`generation.n` choices per prompt, prompt by prompt (every request queued at once).

    With `score_end` (``/v1/completions``) the log-probs cover every generated token, an
    end-of-turn token included: one per token charged in ``usage``, so that a harness's sum
    over ``token_logprobs`` is exact (lm-eval takes the last entry as the generated token).
    Without it (a chat) they cover the tokens the message's text shows, as OpenAI's do."""
    params = SamplingParams(
        max_tokens=max(generation.max_tokens or 1, 1),
        temperature=generation.temperature,
        top_p=generation.top_p,
        seed=generation.seed,
        stop=list(generation.stop) or None,
    )
    responses: list[SampleResponse | None] = [None] * len(prompts)
    if generation.max_tokens != 0:  # /v1/completions max_tokens=0: the prompt scored only
        pending = [
            local_call(
                lambda ids=ids: sampler.sample(ModelInput.from_ints(ids), generation.n, params)
            )
            for ids in prompts
        ]
        responses = [local_call(future.result) for future in pending]
    tokenizer = sampler.get_tokenizer()
    drafts: list[_Draft] = []
    for prompt, response in zip(prompts, responses, strict=True):
        prefix = tokenizer.decode(prompt, skip_special_tokens=False) if echo else ""
        if response is None:
            drafts += [_Draft(prompt, [], prefix, "length", 0)] * generation.n
            continue
        for sequence in response.sequences:
            shown = list(sequence.tokens)
            if shown and shown[-1] in sampler.end_token_ids:
                shown = shown[:-1]  # the end-of-turn token: counted, not shown
            text = sequence.text or ""
            reason = "stop" if sequence.stop_reason == "stop" else "length"
            cuts = [text.find(stop) for stop in generation.stop if stop in text]
            if cuts:
                text, reason = text[: min(cuts)], "stop"
            tokens = list(sequence.tokens) if score_end else shown
            drafts.append(_Draft(prompt, tokens, prefix + text, reason, len(sequence.tokens)))
    if generation.top_logprobs is None:
        return [Choice(d.text, d.reason, d.count, None) for d in drafts]
    scored = _logprobs(
        sampler, [(d.prompt, d.scored) for d in drafts], generation.top_logprobs, echo
    )
    return [
        Choice(d.text, d.reason, d.count, logprobs)
        for d, logprobs in zip(drafts, scored, strict=True)
    ]


@attrs.frozen
class _Draft:
    """A sampled completion before its log-probs: its prompt, the tokens whose log-probs it
    reports, the text (after the echoed prompt), why it ended, and how many tokens it
    generated."""

    prompt: list[int]
    scored: list[int]
    text: str
    reason: str
    count: int


def _logprobs(
    sampler: LocalSamplingClient,
    sequences: Sequence[tuple[list[int], list[int]]],
    top: int,
    echo: bool,
) -> list[tuple[TokenLogprob, ...]]:
    """Each (prompt, completion)'s completion tokens (the prompt's first with `echo`), their
    log-probs and `top` alternatives, from one scoring pass each (queued at once)."""
    tokenizer = sampler.get_tokenizer()
    pending = [
        local_call(lambda ids=prompt + tokens: sampler.score_prompt(ModelInput.from_ints(ids), top))
        for prompt, tokens in sequences
    ]
    scored = []
    for (prompt, tokens), future in zip(sequences, pending, strict=True):
        response = local_call(future.result)
        ids = prompt + tokens
        start = 0 if echo else len(prompt)
        items = []
        for position in range(start, len(ids)):
            value = response.prompt_logprobs[position]
            alternatives = response.topk_prompt_logprobs[position] if top else None
            items.append(
                TokenLogprob(
                    token=_token_text(tokenizer, ids[position]),
                    logprob=math.nan if value is None else float(value),
                    top=tuple(
                        (_token_text(tokenizer, token), float(logprob))
                        for token, logprob in alternatives or ()
                    ),
                )
            )
        scored.append(tuple(items))
    return scored


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)
