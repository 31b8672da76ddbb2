"""`grpo serve`'s OpenAI-compatible ``/v1`` API against a hostile client: a client's own chat
template refused before it runs, a `model` that cannot be loaded a 4xx naming it, a sweep of
malformed bodies each a 4xx naming its field, and a ``null`` body named as such on every route.

Every server binds 127.0.0.1 on a free port (the `served` fixture) and every sweep is bounded
in count; docs/RELIABILITY.md, "The server", states what is promised.
"""

from __future__ import annotations

import inspect
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from grpo.backends.local import tiny
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.serve.messages import Request
from grpo.serve.openai_wire import TEMPLATE_CALL_ARGUMENTS, parse_chat, parse_completion
from grpo.serve.routes import ROUTES
from grpo.serve.wire import ServeError
from tests.serve.conftest import SERVE_API_KEY
from tests.serve.test_serve_hostile import send

KEY = {"Authorization": f"Bearer {SERVE_API_KEY}", "Content-Type": "application/json"}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CHAT = {"model": TINY_MODEL_NAME, "messages": QUESTION, "max_tokens": 2}
COMPLETION = {"model": TINY_MODEL_NAME, "prompt": "12+34=", "max_tokens": 2}
# Two nested loops of the Jinja sandbox's largest range: ~10**10 steps on one core.
NESTED_LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def _post(served: Any, path: str, body: Any) -> tuple[int, str, float]:
    """(status, the error message or the raw body, seconds) of one JSON POST."""
    started = time.monotonic()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = send(served.url, "POST", path, raw, KEY)
    elapsed = time.monotonic() - started
    try:
        decoded = json.loads(reply)
    except ValueError:
        return status, reply.decode(errors="replace"), elapsed
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict):
        return status, str(error.get("message")), elapsed
    message = decoded.get("message") if isinstance(decoded, dict) else None
    return status, str(message if message is not None else decoded), elapsed


def _answers(served: Any) -> None:
    """The server still answers a good chat and a good completion."""
    assert _post(served, "/v1/chat/completions", CHAT)[0] == 200
    assert _post(served, "/v1/completions", COMPLETION)[0] == 200


# --- a client's own chat template ------------------------------------------------------------


def test_a_client_chat_template_is_refused_before_it_runs(served: Any) -> None:
    cases = [
        ({"chat_template_kwargs": {"chat_template": NESTED_LOOPS}}, "chat_template_kwargs.chat"),
        (
            {"chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}},
            "chat_template_kwargs.chat_template",
        ),
        ({"chat_template": NESTED_LOOPS}, "chat_template: a client's own chat template"),
    ]
    for extra, field in cases:
        status, message, elapsed = _post(served, "/v1/chat/completions", {**CHAT, **extra})
        assert status == 400 and field in message, (extra, status, message)
        assert "refused" in message and elapsed < 15, (message, elapsed)
    _answers(served)


@pytest.mark.parametrize(
    "argument",
    [
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "tokenizer_kwargs",
    ],
)
def test_template_kwargs_that_steer_apply_chat_template_are_400s_naming_them(
    argument: str,
) -> None:
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False, argument: True}}
    with pytest.raises(ServeError, match=f"chat_template_kwargs.*{argument}.*apply_chat_template"):
        parse_chat(body)


def test_every_parameter_of_apply_chat_template_is_refused_as_a_template_kwarg() -> None:
    """A transformers upgrade that adds a parameter (one that picks a template, say) fails
    here until the parameter is refused too."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD} - {"self"}
    assert named <= TEMPLATE_CALL_ARGUMENTS, sorted(named - TEMPLATE_CALL_ARGUMENTS)


def test_the_served_model_template_renders_in_a_sandbox() -> None:
    """The served model's own template (the only one rendered) runs in Jinja's immutable
    sandbox, whatever data the client's messages, tools and template variables carry."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template("{{ messages }}")
    assert isinstance(compiled.environment, ImmutableSandboxedEnvironment)


def test_the_template_variables_real_clients_send_still_render(served: Any) -> None:
    sampler = served.state.registry.sampler(TINY_MODEL_NAME)
    tokenizer = sampler.get_tokenizer()
    for variables in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        body = {**CHAT, "chat_template_kwargs": variables}
        status, raw = send(
            served.url, "POST", "/v1/chat/completions", json.dumps(body).encode(), KEY
        )
        assert status == 200, raw[:300]
        prompt = tokenizer.apply_chat_template(
            QUESTION, add_generation_prompt=True, tokenize=False, **(variables or {})
        )
        expected = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert json.loads(raw)["usage"]["prompt_tokens"] == expected


# --- a model that cannot be loaded -----------------------------------------------------------


def _model_copy(tmp_path: Path, name: str) -> Path:
    """A copy of the built-in tiny model's directory, to damage."""
    directory = tmp_path / name
    shutil.copytree(tiny.MODEL_DIRS[TINY_MODEL_NAME], directory)
    return directory


def test_a_model_that_cannot_be_loaded_is_a_4xx_naming_it_and_what_is_wrong(
    served: Any, tmp_path: Path
) -> None:
    not_json = _model_copy(tmp_path, "config-not-json")
    (not_json / "config.json").write_text("{not json")
    no_weights = _model_copy(tmp_path, "no-weights")
    (no_weights / "model.safetensors").unlink()
    unreadable = _model_copy(tmp_path, "unreadable-tokenizer")
    (unreadable / "tokenizer.json").unlink()
    (unreadable / "tokenizer.json").mkdir()  # read as a file: IsADirectoryError
    garbage = _model_copy(tmp_path, "garbage-weights")
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a model")
    cases = [
        (not_json, 400, "config.json"),
        (no_weights, 400, "model.safetensors"),
        (unreadable, 400, "tokenizer"),
        (garbage, 400, "cannot be loaded"),
        (no_config, 404, "a directory without a config.json"),
        (a_file, 404, "is a file, not a model directory"),
    ]
    for directory, expected, problem in cases:
        for path, body in (
            ("/v1/completions", {**COMPLETION, "model": str(directory)}),
            ("/v1/chat/completions", {**CHAT, "model": str(directory)}),
        ):
            status, message, _ = _post(served, path, body)
            assert status == expected, (directory.name, status, message)
            assert str(directory) in message and problem in message, message
    odd_names = [
        "~no-such-user-here/model",
        "local://~no-such-user-here/model",
        "a\x00b",
        "a\ud800b",  # a lone surrogate: no file-system encoding takes it
        "x" * 300,  # one component longer than a file name may be
        "line\nbreak",
        "/dev/null",
        str(a_file) + "/below-a-file",
    ]
    for name in odd_names:
        status, message, _ = _post(served, "/v1/completions", {**COMPLETION, "model": name})
        assert 400 <= status < 500 and "model" in message, (name, status, message)
    # The PyTRIO routes resolve models and checkpoints the same way.
    api = "/api/openapi/v1/service-sessions"
    session = json.loads(send(served.url, "POST", api, b"{}", KEY)[1])["service_session_cuid"]
    lora = {"lora_rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": False}
    for create in (
        {"base_model": "~no-such-user-here/model"},
        {"base_model": TINY_MODEL_NAME, "source_checkpoint_uri": "~no-such-user-here/ckpt"},
    ):
        status, message, _ = _post(served, f"{api}/{session}/training-runs", {**lora, **create})
        assert 400 <= status < 500 and "~no-such-user-here" in message, (status, message)
    _answers(served)


# --- malformed bodies ------------------------------------------------------------------------

# (the field the message must name, the broken part of the body), for each endpoint
CHAT_BREAKS: list[tuple[str, dict[str, Any]]] = [
    ("messages", {"messages": None}),
    ("messages", {"messages": "hi"}),
    ("messages", {"messages": []}),
    ("messages[0].role", {"messages": [5]}),
    ("messages[0].role", {"messages": [{"content": "hi"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": 5}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": {"text": "x"}}]}),
    ("messages[0].content[0]", {"messages": [{"role": "user", "content": [5]}]}),
    (
        "messages[0].tool_calls",
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]},
    ),
    (
        "messages[0].tool_calls",
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [5]}]},
    ),
    ("tools", {"tools": {"type": "function"}}),
    ("tools", {"tools": [5]}),
    ("logprobs", {"logprobs": "yes"}),
    ("logprobs", {"logprobs": 2}),
    ("logprobs", {"logprobs": -0.0}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": "2"}),
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": "2"}),
    ("n", {"n": True}),
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": "8"}),
    ("max_tokens", {"max_tokens": 10**30}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": "0"}),
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": 1e308}),
    ("top_p", {"top_p": 2}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": [1, 2]}),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
    ("user", {"user": 5}),
    ("user", {"user": ["me"]}),
    ("parallel_tool_calls", {"parallel_tool_calls": "yes"}),
    ("chat_template_kwargs", {"chat_template_kwargs": []}),
    ("chat_template_kwargs", {"chat_template_kwargs": "enable_thinking"}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"tokenize": True}}),
    ("stream", {"stream": "false"}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("model", {"model": None}),
    ("model", {"model": 5}),
    ("model", {"model": "no/such-model"}),
    ("unrecognized", {"temprature": 0.5}),
]
COMPLETION_BREAKS: list[tuple[str, dict[str, Any]]] = [
    ("prompt", {"prompt": None}),
    ("prompt", {"prompt": 5}),
    ("prompt", {"prompt": [1.5]}),
    ("prompt", {"prompt": [[1], "a", 5]}),
    ("prompt", {"prompt": [-1]}),
    ("prompt", {"prompt": [10**12]}),
    ("logprobs", {"logprobs": True}),
    ("logprobs", {"logprobs": 21}),
    ("echo", {"echo": "yes"}),
    ("echo", {"echo": 0.0}),
    ("best_of", {"best_of": 2}),
    ("best_of", {"best_of": True}),
    ("suffix", {"suffix": "end"}),
    ("max_tokens", {"max_tokens": 1.5}),
    ("n", {"n": 129}),
    ("stop", {"stop": {"a": 1}}),
    ("user", {"user": {"id": 1}}),
]


def test_malformed_bodies_are_4xx_naming_the_field_and_the_server_answers_on(
    served: Any,
) -> None:
    cases = [("/v1/chat/completions", CHAT, *case) for case in CHAT_BREAKS]
    cases += [("/v1/completions", COMPLETION, *case) for case in COMPLETION_BREAKS]
    failures = []
    for path, valid, field, broken in cases:
        status, message, _ = _post(served, path, {**valid, **broken})
        if not (400 <= status < 500 and field in message):
            failures.append((path, broken, status, message[:200]))
    assert not failures, failures
    _answers(served)


def test_flags_take_true_false_and_the_0_and_1_lenient_clients_send() -> None:
    for value, expected in [(True, True), (False, False), (1, True), (0, False), (None, False)]:
        assert parse_completion({**COMPLETION, "echo": value}).echo is expected
        assert (parse_chat({**CHAT, "logprobs": value}).generation.top_logprobs == 0) is expected
    for value in (2, 0.0, "true", [True]):
        with pytest.raises(ServeError, match="echo must be true or false"):
            parse_completion({**COMPLETION, "echo": value})


# --- a body that is JSON null ----------------------------------------------------------------


def test_a_null_body_is_told_to_be_a_json_object() -> None:
    for body, kind in [(b"null", "null"), (b"[1]", "an array"), (b'"x"', "a string")]:
        with pytest.raises(ServeError, match=f"must be a JSON object.*got {kind}"):
            Request("POST", "/v1/completions", {}, {}, body).json()
    deep = b'{"a":' * 40 + b"1" + b"}" * 40
    with pytest.raises(ServeError, match="nested more than 32 levels"):
        Request("POST", "/v1/completions", {}, {}, deep).json()


def test_no_route_calls_a_null_body_too_deep(served: Any) -> None:
    """Every POST/PATCH route that reads a JSON body says it must be an object; none calls
    ``null`` nested, and none answers it with a 5xx."""
    read_json = []
    for route in ROUTES:
        if route.method not in ("POST", "PATCH") or "/actor/" in route.path.pattern:
            continue  # the Actor API's events are msgpack envelopes
        path = route.path.pattern.replace(r"\.", ".").replace("([^/]+)", "nope")
        status, reply = send(served.url, route.method, path, b"null", KEY)
        assert status < 500 and b"nested" not in reply, (path, status, reply[:200])
        if b"must be a JSON object" in reply:
            read_json.append(path)
    assert {"/v1/chat/completions", "/v1/completions"} <= set(read_json), read_json
    assert any("training-runs" in path for path in read_json), read_json
