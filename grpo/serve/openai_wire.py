"""The OpenAI wire format of `grpo serve`'s ``/v1/`` API: requests checked and bounded into
records, and the response bodies built from what was sampled (no state, no I/O).

``POST /v1/chat/completions`` takes ``messages`` (rendered by the model's chat template,
``tools`` and ``chat_template_kwargs`` passed to it as data: a client's own template is
refused, `TEMPLATE_CALL_ARGUMENTS`); ``POST /v1/completions`` takes a
``prompt`` (a string, a list of strings, a list of token ids or a list of those). Both take
``model``, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stop`` and log-probs
(chat: ``logprobs`` + ``top_logprobs``; completions: ``logprobs`` = the top count, and
``echo``). A field OpenAI defines that the server cannot honour (``frequency_penalty`` 0.5,
``stream``) is a 400 naming it unless it has its neutral value; an unknown field is a 400
listing the known ones, as OpenAI's own API answers. Every list, string and count is bounded
before anything is tokenized (`MAX_CHOICES`, `MAX_PROMPTS`, `MAX_MESSAGES`,
`MAX_PROMPT_CHARS`, `MAX_STOP`, `MAX_TOP_LOGPROBS`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from grpo.serve.limits import MAX_FIELD_CHARS, check_name
from grpo.serve.wire import ServeError

OPENAI_PREFIX = "/v1/"  # the OpenAI-compatible API's paths
MAX_CHOICES = 128  # OpenAI's own bound on n
MAX_PROMPTS = 64
MAX_MESSAGES = 4096
MAX_PROMPT_CHARS = 2**20  # characters of text (or token ids) in one request's prompts
MAX_STOP = 4  # OpenAI's own bound
MAX_TOP_LOGPROBS = 20  # OpenAI's own bound
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")

_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "user")
_CHAT = (
    *_COMMON,
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "parallel_tool_calls",
    "chat_template_kwargs",
)
_COMPLETION = (*_COMMON, "prompt", "logprobs", "echo", "best_of", "suffix")
# Fields accepted at these (neutral) values only: anything else would ask for what the
# server does not do.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "stream_options": (None,),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "metadata": (None, {}),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
}
# apply_chat_template's own parameters (a test checks the installed transformers' list), and
# the name the template gets the messages under: in chat_template_kwargs they would pick the
# template or steer the call instead of filling in one of the template's variables. A
# client's `chat_template` would run its Jinja on the server: two nested loops of the
# sandbox's largest range held a core long after the client gave up (docs/RELIABILITY.md,
# "The server").
TEMPLATE_CALL_ARGUMENTS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)
_CLIENT_TEMPLATE = (
    "a client's own chat template is refused: the server renders every chat with the served "
    "model's template; leave chat_template out and send the messages"
)
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    **_NEUTRAL,
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"),  # the template offers the tools; the model picks
}


def _invalid(message: str) -> ServeError:
    return ServeError(400, "invalid_request_error", message)


@attrs.frozen
class Generation:
    """What to sample, for each prompt: `n` completions of at most `max_tokens` tokens
    (None: the endpoint's default), at `temperature` / `top_p`, from `seed` (None: drawn),
    cut at the first of `stop`; `top_logprobs` None for no log-probs, k >= 0 for each
    token's log-prob and its k most likely alternatives."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: tuple[str, ...]
    top_logprobs: int | None


@attrs.frozen
class ChatRequest:
    """A ``/v1/chat/completions`` request: the generation, the messages (content as text),
    the tools and the extra chat-template arguments."""

    generation: Generation
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    template_kwargs: dict[str, Any]


@attrs.frozen
class CompletionRequest:
    """A ``/v1/completions`` request: the generation, the prompts (text or token ids), and
    whether the prompt is echoed before each completion (`echo`)."""

    generation: Generation
    prompts: tuple[str | tuple[int, ...], ...]
    echo: bool


@attrs.frozen
class TokenLogprob:
    """One token's text, log-prob and its most likely alternatives (text, log-prob)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@attrs.frozen
class Choice:
    """One sampled completion: its text, why it ended ("stop" / "length"), its token count,
    and its tokens' log-probs when asked (with `echo`, the prompt's first)."""

    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None


# --- requests -------------------------------------------------------------------------------


def _check_fields(
    body: dict[str, Any], known: Sequence[str], neutrals: dict[str, tuple[Any, ...]]
) -> None:
    unknown = sorted(set(body) - set(known) - set(neutrals))
    if unknown:
        raise _invalid(
            f"unrecognized request argument(s) {unknown}; this server takes "
            f"{sorted({*known, *neutrals})}"
        )
    for field, neutral in neutrals.items():
        if field in body and not any(body[field] == value for value in neutral):
            hint = " (responses come whole)" if field.startswith("stream") else ""
            raise _invalid(
                f"{field}={body[field]!r:.80} is not supported by grpo serve{hint}; "
                f"leave it out or send {neutral[-1]!r}"
            )


def _int(body: dict[str, Any], field: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _invalid(f"{field} must be an integer in [{low}, {high}], got {value!r:.80}")
    return value


def _number(body: dict[str, Any], field: str, default: float, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise _invalid(f"{field} must be a number in [{low:g}, {high:g}], got {value!r:.80}")
    return float(value)


def _flag(body: dict[str, Any], field: str) -> bool:
    """A true/false field (absent or null: false; 0 and 1 taken as vLLM's pydantic does)."""
    value = body.get(field)
    if value is not None and not (
        isinstance(value, bool) or (type(value) is int and value in (0, 1))
    ):
        raise _invalid(f"{field} must be true or false, got {value!r:.40}")
    return bool(value)


def _stop(value: Any) -> tuple[str, ...]:
    items = [] if value is None else [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP
        or not all(isinstance(item, str) and 0 < len(item) <= MAX_FIELD_CHARS for item in items)
    ):
        raise _invalid(
            f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, "
            f"got {value!r:.80}"
        )
    return tuple(items)


def _generation(
    body: dict[str, Any], max_tokens: int | None, top_logprobs: int | None
) -> Generation:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid(
            f"model must be a served model's name or a sampler weights path, got {model!r:.80}"
        )
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    assert n is not None
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid(f"user must be a string (an end user's id), got {user!r:.40}")
    check_name("user", user or "")
    return Generation(
        model=check_name("model", model),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,  # top_p 0: the likeliest only
        n=n,
        seed=_int(body, "seed", None, 0, 2**63 - 1),
        stop=_stop(body.get("stop")),
        top_logprobs=top_logprobs,
    )


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _invalid(f"{where} must be a string or a list of content parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise _invalid(
                f"{where}[{index}] is a {kind!r:.40} part; the local backend takes text parts "
                "only ({'type': 'text', 'text': ...})"
            )
        texts.append(part["text"])
    return "".join(texts)


def _message(raw: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        role = raw.get("role") if isinstance(raw, dict) else raw
        raise _invalid(f"{where}.role must be one of {list(ROLES)}, got {role!r:.80}")
    message = dict(raw)
    message["content"] = _text_content(raw.get("content"), f"{where}.content")
    if message["role"] == "developer":  # OpenAI's newer name for the system turn
        message["role"] = "system"
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(call, dict) for call in calls)
    ):
        raise _invalid(
            f"{where}.tool_calls must be a list of tool call objects "
            "({'type': 'function', 'function': {'name': ..., 'arguments': ...}}), "
            f"got {calls!r:.80}"
        )
    for call in calls or []:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:  # chat templates (Qwen3's) render the arguments as a mapping
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
    return message


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    """A checked `ChatRequest` from a ``/v1/chat/completions`` body (400 naming the field)."""
    if "chat_template" in body:  # vLLM's field for a client's own template
        raise _invalid(f"chat_template: {_CLIENT_TEMPLATE}")
    _check_fields(body, _CHAT, _CHAT_NEUTRAL)
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise _invalid(f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    parsed = tuple(_message(raw, index) for index, raw in enumerate(messages))
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)
    ):
        raise _invalid("tools must be a list of tool objects ({'type': 'function', ...})")
    _flag(body, "parallel_tool_calls")
    kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    size = (
        sum(len(message["content"]) for message in parsed)
        + sum(len(json.dumps({**message, "content": ""})) for message in parsed)
        + len(json.dumps(tools or []))
        + len(json.dumps(kwargs))
    )
    if size > MAX_PROMPT_CHARS:
        raise _invalid(
            f"messages, tools and chat_template_kwargs hold {size} characters; "
            f"at most {MAX_PROMPT_CHARS}"
        )
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    logprobs = _flag(body, "logprobs")
    if top is not None and not logprobs:
        raise _invalid("top_logprobs needs logprobs=true")
    max_tokens = _int(body, "max_completion_tokens", None, 1, 2**31)
    max_tokens = _int(body, "max_tokens", max_tokens, 1, 2**31)
    generation = _generation(body, max_tokens, (top or 0) if logprobs else None)
    return ChatRequest(generation, parsed, tuple(tools) if tools is not None else None, kwargs)


def _template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs``: the template's own variables, as data (400 naming a key
    that would choose the template or steer `apply_chat_template`)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(
            "chat_template_kwargs must be an object of the chat template's variables "
            f"(e.g. {{'enable_thinking': false}}), got {value!r:.80}"
        )
    if "chat_template" in value:
        raise _invalid(f"chat_template_kwargs.chat_template: {_CLIENT_TEMPLATE}")
    steering = sorted(TEMPLATE_CALL_ARGUMENTS & set(value))
    if steering:
        raise _invalid(
            f"chat_template_kwargs {steering} are arguments of apply_chat_template, not "
            "variables of the chat template; the server renders the messages and tools with "
            "add_generation_prompt=true. Send the template's own variables only "
            "(e.g. {'enable_thinking': false})"
        )
    return value


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """The prompts of a completions body: a string, a list of strings, a list of token ids,
    or a list of such lists."""

    def ids(item: Any) -> bool:
        return isinstance(item, list) and all(
            isinstance(token, int) and not isinstance(token, bool) for token in item
        )

    if isinstance(value, str) or (ids(value) and value):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and all(isinstance(item, str) or ids(item) for item in value):
        prompts = value
    else:
        raise _invalid(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            f"token-id lists; got {type(value).__name__}"
        )
    if not 0 < len(prompts) <= MAX_PROMPTS or not all(prompts):
        raise _invalid(f"prompt must hold 1 to {MAX_PROMPTS} non-empty prompts")
    size = sum(len(prompt) for prompt in prompts)
    if size > MAX_PROMPT_CHARS:
        raise _invalid(f"prompt holds {size} characters or tokens; at most {MAX_PROMPT_CHARS}")
    return tuple(prompt if isinstance(prompt, str) else tuple(prompt) for prompt in prompts)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """A checked `CompletionRequest` from a ``/v1/completions`` body (400 naming the field)."""
    _check_fields(body, _COMPLETION, _NEUTRAL)
    if body.get("suffix") not in (None, ""):
        raise _invalid("suffix is not supported by grpo serve (no fill-in-the-middle)")
    echo = _flag(body, "echo")
    prompts = _prompts(body.get("prompt"))
    top = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    generation = _generation(
        body, _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0, 2**31), top
    )
    best_of = _int(body, "best_of", generation.n, 1, MAX_CHOICES)
    if best_of != generation.n:
        raise _invalid(f"best_of must equal n ({generation.n}) here, got {best_of!r:.40}")
    return CompletionRequest(generation, prompts, echo)


# --- responses ------------------------------------------------------------------------------


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(choice.completion_tokens for choice in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_completion_body(model: str, choices: Sequence[Choice], prompt_tokens: int) -> dict:
    """The ``chat.completion`` object of sampled `choices` (their index is their order)."""

    def logprobs(choice: Choice) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        content = [
            {
                "token": item.token,
                "logprob": item.logprob,
                "bytes": _bytes(item.token),
                "top_logprobs": [
                    {"token": token, "logprob": value, "bytes": _bytes(token)}
                    for token, value in item.top
                ],
            }
            for item in choice.logprobs
        ]
        return {"content": content, "refusal": None}

    return _response_body(
        "chatcmpl",
        "chat.completion",
        model,
        [
            {
                "index": index,
                "message": {"role": "assistant", "content": choice.text, "refusal": None},
                "logprobs": logprobs(choice),
                "finish_reason": choice.finish_reason,
            }
            for index, choice in enumerate(choices)
        ],
        _usage(prompt_tokens, choices),
    )


def completion_body(model: str, choices: Sequence[Choice], prompt_tokens: int) -> dict:
    """The ``text_completion`` object of sampled `choices` (prompt by prompt, n each)."""

    def logprobs(choice: Choice) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        offsets, offset = [], 0
        for item in choice.logprobs:
            offsets.append(offset)
            offset += len(item.token)
        return {
            "tokens": [item.token for item in choice.logprobs],
            "token_logprobs": [
                None if math.isnan(item.logprob) else item.logprob for item in choice.logprobs
            ],
            "top_logprobs": [
                None if math.isnan(item.logprob) else dict(item.top) for item in choice.logprobs
            ],
            "text_offset": offsets,
        }

    return _response_body(
        "cmpl",
        "text_completion",
        model,
        [
            {
                "index": index,
                "text": choice.text,
                "logprobs": logprobs(choice),
                "finish_reason": choice.finish_reason,
            }
            for index, choice in enumerate(choices)
        ],
        _usage(prompt_tokens, choices),
    )


def _response_body(
    id_prefix: str, object_name: str, model: str, choices: list[dict], usage: dict
) -> dict:
    """An OpenAI response object: a fresh id, its type, the time, the model, choices, usage."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def model_list_body(names: Sequence[str]) -> dict[str, Any]:
    """The ``list`` of served model names (``GET /v1/models``)."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "grpo serve"}
            for name in names
        ],
    }


_ERROR_TYPES = {
    "unauthorized": "authentication_error",
    "forbidden": "permission_error",
    "too_many_requests": "rate_limit_error",
    "service_unavailable": "server_error",
    "internal_error": "server_error",
}


def openai_error_body(code: str, message: str) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(code, "invalid_request_error")
    if code == "unauthorized":
        message = (
            "missing or wrong API key; pass the key given to `grpo serve --api-key` "
            "(OpenAI(api_key=...), or OPENAI_API_KEY)"
        )
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
