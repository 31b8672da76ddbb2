"""`grpo serve` against a hostile client: auth before the body, bounds, tokens, a route fuzz.

Every server binds 127.0.0.1 on a free port and is closed by its test; every load is
bounded in count and time (docs/RELIABILITY.md, "The server").
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgpack
import pytest
import pytrio

from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.serve.routes import ROUTES
from grpo.serve.server import serve_in_thread, start_server
from tests.serve.conftest import SERVE_API_KEY

API = "/api/openapi/v1"
KEY = {"X-API-Key": SERVE_API_KEY}


def send(
    url: str,
    method: str,
    path: str,
    body: bytes | None = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body); a None body sends no Content-Length."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body or None)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def raw_exchange(url: str, head: bytes, wait_s: float = 5.0) -> bytes:
    """Send `head` (and no body) on a raw socket; what the server answers before it closes
    the connection, or within `wait_s`."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as connection:
        connection.sendall(head)
        try:
            while chunk := connection.recv(65536):  # the server closes: the body is unread
                answer += chunk
        except TimeoutError:
            pass
    return answer


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Any]:
    """A server that requires `SERVE_API_KEY` (no pytrio pointed at it)."""
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        yield handle


# --- 1. authentication before the body, size limits ---------------------------------------


def test_an_unauthenticated_huge_body_is_refused_before_a_byte_of_it_is_read(keyed: Any) -> None:
    head = (
        f"POST {API}/service-sessions HTTP/1.1\r\nHost: x\r\n"
        "Content-Length: 300000000\r\nContent-Type: application/json\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answer = raw_exchange(keyed.url, head)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    assert time.monotonic() - started < 5


def test_a_body_over_the_limit_or_without_a_valid_length_is_refused_unread(
    tmp_path: Path,
) -> None:
    with serve_in_thread(
        root=tmp_path / "served", api_key=SERVE_API_KEY, max_request_bytes=1000
    ) as handle:
        path = f"{API}/service-sessions"
        too_big = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {SERVE_API_KEY}\r\n"
            "Content-Length: 1001\r\n\r\n"
        ).encode()
        answer = raw_exchange(handle.url, too_big)
        assert answer.startswith(b"HTTP/1.1 413") and b"--max-request-bytes" in answer
        status, body = send(handle.url, "POST", path, None, KEY)
        assert status == 411 and b"Content-Length" in body
        status, body = send(handle.url, "POST", path, None, {**KEY, "Content-Length": "abc"})
        assert status == 400 and b"Content-Length" in body
        chunked = {**KEY, "Transfer-Encoding": "chunked"}
        assert send(handle.url, "POST", path, None, chunked)[0] == 411
        assert send(handle.url, "POST", path, b"{}", KEY)[0] == 200  # under the limit: served


# --- 2. the API key ------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   ", "\t\n"])
def test_an_empty_or_whitespace_api_key_is_an_error_at_start(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="empty or whitespace"):
        start_server(root=tmp_path / "served", api_key=key)


def test_binding_off_loopback_without_a_key_is_an_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give it a key"):
        start_server(root=tmp_path / "served", host="0.0.0.0")


def test_grpo_serve_with_an_empty_api_key_exits_2(tmp_path: Path) -> None:
    from grpo.serve.command import run_serve

    lines: list[str] = []
    args = _serve_args("--api-key", "", "--port", "0", "--root", str(tmp_path))
    assert run_serve(args, echo=lines.append) == 2
    assert "empty or whitespace" in lines[0]


def _serve_args(*argv: str) -> Any:
    import argparse

    from grpo.serve.command import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("name", "flag", "value"),
    [
        ("max_request_bytes", "--max-request-bytes", 0),
        ("max_connections", "--max-connections", -1),
        ("request_timeout_s", "--request-timeout", 0.0),
        ("max_batch_size", "--max-batch-size", 0),
        ("max_tokens_per_request", "--max-tokens-per-request", -2),
        ("tinker_session_expiry_s", "--tinker-session-expiry", 0.0),
    ],
)
def test_a_bound_that_would_disable_itself_is_refused_whoever_starts_the_server(
    tmp_path: Path, name: str, flag: str, value: float
) -> None:
    """0 connections would answer every request 503: refused at start, from a program (the
    flag named) and from `grpo serve` (exit 2, one line), before anything binds."""
    from grpo.serve.command import run_serve

    with pytest.raises(ValueError, match=f"^{flag} must be > 0, got {value}$"):
        serve_in_thread(root=tmp_path / "served", **{name: value})
    lines: list[str] = []
    args = _serve_args(flag, str(value), "--port", "0", "--root", str(tmp_path / "cli"))
    assert run_serve(args, echo=lines.append) == 2
    assert lines == [f"grpo serve: {flag} must be > 0, got {value}"]
    assert not (tmp_path / "cli").exists()


def test_every_option_of_start_server_is_a_grpo_serve_flag_with_its_default() -> None:
    """`grpo serve` passes its flags to `start_server` by name: each parameter (but the key,
    the fault plan and the aliases, built from their flags) is a flag's destination, with
    start_server's default (the port aside: the command's is fixed, a program's any free one)."""
    import inspect

    from grpo.serve.command import BUILT_OPTIONS, DEFAULT_PORT, served_flags

    parameters = inspect.signature(start_server).parameters
    passed = served_flags(_serve_args())
    assert set(passed) | set(BUILT_OPTIONS) == set(parameters)
    defaults = {name: parameters[name].default for name in passed}
    assert passed == {**defaults, "port": DEFAULT_PORT}
    flags = _serve_args("--request-timeout", "7", "--tinker-session-expiry", "9")
    assert served_flags(flags)["request_timeout_s"] == 7.0
    assert served_flags(flags)["tinker_session_expiry_s"] == 9.0


def test_keys_are_compared_in_constant_time(keyed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    calls: list[bytes] = []
    compare = hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        calls.append(expected)
        return compare(given, expected)

    monkeypatch.setattr("grpo.serve.access.hmac.compare_digest", spy)
    assert send(keyed.url, "GET", "/api/models", None, {"X-API-Key": "wrong"})[0] == 401
    assert send(keyed.url, "GET", "/api/models", None, KEY)[0] == 200
    assert SERVE_API_KEY.encode() in calls


# --- 3. download tokens --------------------------------------------------------------------


def test_a_download_token_opens_its_own_checkpoint_only_and_expires(served: Any) -> None:
    service = pytrio.ServiceClient()
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    training.save_state("a").result()
    training.save_state("b").result()
    rest = service.create_rest_client()
    first, second = rest.list_checkpoints(training.training_run_cuid).result().checkpoints

    def download_url(cuid: str) -> dict[str, Any]:
        path = f"{API}/checkpoints/{cuid}/download-url"
        return json.loads(send(served.url, "GET", path, None, KEY)[1])

    a, again = download_url(first.checkpoint_id), download_url(first.checkpoint_id)
    assert a["url"] != again["url"]  # a fresh unguessable token each time
    expires_at = datetime.fromisoformat(a["expires_at"])
    assert 14 * 60 < expires_at.timestamp() - time.time() <= 15 * 60
    path_a = a["url"].removeprefix(served.url)
    token = path_a.split("token=")[1]
    assert len(token) >= 32
    assert send(served.url, "GET", path_a, None)[0] == 200
    path_b = f"/files/checkpoints/{second.checkpoint_id}.tar?token={token}"
    status, body = send(served.url, "GET", path_b, None)
    assert status == 403 and second.checkpoint_id.encode() in body
    assert send(served.url, "GET", path_a.split("?")[0], None)[0] == 403
    tokens = served.state.registry.downloads._tokens
    checkpoint, _expires = tokens[token]
    tokens[token] = (checkpoint, expires_at.replace(year=2000))
    status, body = send(served.url, "GET", path_a, None)
    assert status == 403 and b"expired" in body


# --- 4. damaged store entries --------------------------------------------------------------


def test_a_damaged_store_entry_is_a_409_naming_the_file(served: Any) -> None:
    service = pytrio.ServiceClient()
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    state = training.save_state("kept").result()
    directory = Path(state.path.removeprefix("local://"))
    (directory / "grpo_local.json").write_text("{not json")
    query = f"{API}/training-runs/by-checkpoint-uri?checkpoint_uri={state.path}"
    status, body = send(served.url, "GET", query, None, KEY)
    assert status == 409 and b"grpo_local.json" in body, body
    session = json.loads(send(served.url, "POST", f"{API}/service-sessions", b"{}", KEY)[1])
    create = json.dumps({"base_model": TINY_MODEL_NAME, "source_checkpoint_uri": state.path})
    sampling = f"{API}/service-sessions/{session['service_session_cuid']}/sampling-runs"
    status, body = send(served.url, "POST", sampling, create.encode(), KEY)
    assert status == 409 and b"grpo_local.json" in body, body
    lora_missing = {"format": 1, "base_model": TINY_MODEL_NAME}
    (directory / "grpo_local.json").write_text(json.dumps(lora_missing))
    status, body = send(served.url, "GET", query, None, KEY)
    assert status == 409 and b"grpo_local.json" in body, body
    (directory / "grpo_local.json").unlink()
    (cuid,) = served.state.registry._checkpoints
    url = served.state.registry.download_url(cuid)["url"].removeprefix(served.url)
    status, body = send(served.url, "GET", url, None)
    assert status == 409 and b"gone" in body, body


# --- 5. the route fuzz ---------------------------------------------------------------------

HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    -1,
    10**30,  # JSON only: msgpack stops at 2**64 - 1
    1.5,
    True,
    "x" * 5000,
    "\x00",
    "../../etc",
    [["nested"]],
    {"a": {"b": 1}},
    ["not-an-int"],
)
FIELDS = (
    "base_model",
    "source_checkpoint_uri",
    "restore_optimizer",
    "lora_rank",
    "seed",
    "train_mlp",
    "status",
    "request_id",
    "prompt",
    "sampling_params",
    "num_samples",
    "topk_prompt_logprobs",
)


def _bodies(valid: dict[str, Any]) -> Iterator[tuple[str, bytes | None, dict[str, str]]]:
    """(what it is, body, extra headers): malformed forms, then `valid` with one field broken."""
    json_type = {"Content-Type": "application/json"}
    yield "no body, no Content-Length", None, {}
    yield "empty", b"", json_type
    yield "garbage", bytes(range(256)) * 4, json_type
    yield "wrong content type", b"<xml/>", {"Content-Type": "text/xml"}
    yield "null", b"null", json_type
    yield "array", b"[1, 2]", json_type
    yield "1000-deep", b"[" * 1000 + b"]" * 1000, json_type
    yield "100000-deep", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, json_type
    yield "msgpack garbage", b"\xc1\xc1\xc1", {"Content-Type": "application/msgpack"}
    yield "msgpack deep", b"\x91" * 5000 + b"\x01", {"Content-Type": "application/msgpack"}
    for field in (*valid, *FIELDS):
        for value in HOSTILE_VALUES[:: 1 if field in valid else 4]:
            body = {**valid, field: value}
            yield f"{field}={value!r:.20}", json.dumps(body).encode(), json_type
        if field in valid:
            rest = {k: v for k, v in valid.items() if k != field}
            yield f"no {field}", json.dumps(rest).encode(), json_type


def _envelopes(run: str) -> Iterator[tuple[str, bytes | None, dict[str, str]]]:
    """Msgpack event envelopes with hostile metadata and payloads (each a fresh event id)."""
    packed = {"Content-Type": "application/msgpack"}
    count = iter(range(10**6))

    def envelope(kind: str, payload: Any, run_id: Any = run) -> bytes:
        event_id = f"event_{next(count):012d}"
        metadata = {"index": 1, "step": 0, "timestamp": 0, "sdk": "x", "sdk_version": "0"}
        return msgpack.packb(
            {
                "version": 1,
                "event_id": event_id,
                "type": kind,
                "metadata": {**metadata, "run_id": run_id},
                "payload": payload,
            }
        )

    kinds = ("trainer.init_run", "trainer.forward_backward", "trainer.save_state")
    huge = 2**64 - 1  # msgpack's largest integer
    for kind in (*kinds, "no.such.event"):
        for value in [huge if value == 10**30 else value for value in HOSTILE_VALUES[::2]]:
            yield f"{kind} payload={value!r:.20}", envelope(kind, {"data": value}), packed
            yield f"{kind} run_id={value!r:.20}", envelope(kind, {}, value), packed
    lora = {"rank": 10**9, "seed": -1, "train_mlp": True, "train_attn": True}
    yield "huge rank", envelope("trainer.init_run", {"lora_config": lora}), packed
    chunk = {"tokens": ["a"], "type": "encoded_text"}
    datum = {"model_input": {"chunks": [chunk]}, "target_ids": [huge]}
    yield "wrong types", envelope("trainer.forward", {"data": [datum]}), packed
    yield "unknown run", envelope("trainer.forward", {}, "train-nope"), packed


def _route_path(pattern: str, ids: list[str]) -> str:
    """The route's path regex with its groups filled in by `ids`, in order."""
    path = pattern.replace(r"\.", ".")
    for value in ids:
        path = path.replace("([^/]+)", value, 1)
    return path


def test_fuzz_every_route_no_5xx_and_every_error_names_something(tmp_path: Path) -> None:
    started = time.monotonic()
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        url = handle.url
        session = json.loads(send(url, "POST", f"{API}/service-sessions", b"{}", KEY)[1])
        sid = session["service_session_cuid"]
        create = {
            "base_model": TINY_MODEL_NAME,
            "lora_rank": 4,
            "train_mlp": True,
            "train_attn": True,
            "train_unembed": False,
        }
        run = json.loads(
            send(
                url,
                "POST",
                f"{API}/service-sessions/{sid}/training-runs",
                json.dumps(create).encode(),
                KEY,
            )[1]
        )
        actor = {"Authorization": f"Bearer {run['actor_jwt']['token']}"}
        tried, failures = 0, []
        for route in ROUTES:
            ids_known = {
                1: [sid if "service-sessions" in route.path.pattern else run["training_run_cuid"]],
                2: [sid, run["training_run_cuid"]],
            }.get(route.path.pattern.count("([^/]+)"), [])
            unknown = ["nope"] * route.path.pattern.count("([^/]+)")
            auth = {"control": KEY, "actor": actor}.get(route.auth, {})
            valid = {
                "create_training_run": create,
                "create_sampling_run": {"base_model": "no/such-model"},
                "update_training_run": {"source_checkpoint_uri": "nope", "restore_optimizer": 0},
                "sample": {
                    "request_id": "r",
                    "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                    "sampling_params": {"max_tokens": 2},
                },
                "chat_completions": {
                    "model": TINY_MODEL_NAME,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "logprobs": True,
                    "top_logprobs": 1,
                },
                "completions": {"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": 2},
            }.get(route.operation, {"status": "ENDED"})
            destructive = route.method == "DELETE" or route.path.pattern.endswith("/close")
            id_sets = [unknown] if destructive or not unknown else [unknown, ids_known]
            cases = list(_bodies(valid)) if route.method in ("POST", "PATCH") else []
            if route.auth == "actor" and route.method == "POST":
                cases += list(_envelopes(run["training_run_cuid"]))
            cases += [("query", b"", {}), ("wait", b"", {"Prefer": "wait=99999999"})]
            for ids in id_sets:
                base = _route_path(route.path.pattern, ids)
                for query in ("", "?limit=-1&offset=x", "?limit=" + "9" * 5000, "?token=zz"):
                    for what, body, extra in cases:
                        if route.method in ("GET", "HEAD", "DELETE") and what != "query":
                            body = b""
                        status, reply = send(
                            url, route.method, base + query, body, {**auth, **extra}
                        )
                        tried += 1
                        named = route.method == "HEAD" or status < 400 or _message(reply)
                        if status >= 500 or not named:
                            failures.append(
                                (route.method, base + query[:20], what, status, reply[:160])
                            )
            assert time.monotonic() - started < 120, f"fuzz too slow after {tried} cases"
        for method in ("PUT", "OPTIONS"):
            status, reply = send(url, method, f"{API}/service-sessions", b"", KEY)
            tried += 1
            if status >= 500 or not _message(reply):
                failures.append((method, "service-sessions", "", status, reply[:160]))
    print(f"fuzz: {tried} cases, {len(failures)} failures")
    assert not failures, failures[:10]


def _message(reply: bytes) -> str:
    """The message of a JSON error body (PyTRIO's, or OpenAI's ``{"error": {...}}`` on
    ``/v1/``), or "" when it is none."""
    try:
        body = json.loads(reply)
    except ValueError:
        try:
            body = msgpack.unpackb(reply)
        except Exception:  # noqa: BLE001 - not msgpack either: no message
            return ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and "code" not in body:
        body = body["error"]
    return str(body.get("message", "")) if isinstance(body, dict) else ""


# --- 6. many clients -----------------------------------------------------------------------


def _served_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("Thread-"))


def _request_with_retries(url: str, within_s: float) -> tuple[int, float]:
    """GET /api/models, retrying 503 as pytrio does: (final status, seconds it took)."""
    started = time.monotonic()
    while True:
        status, _body = send(url, "GET", "/api/models", None, KEY)
        if status != 503 or time.monotonic() - started > within_s:
            return status, time.monotonic() - started
        time.sleep(0.2)


@pytest.mark.parametrize("max_connections", [8, None])
def test_idle_connections_neither_starve_the_server_nor_multiply_its_threads(
    tmp_path: Path, max_connections: int | None
) -> None:
    bounds = {"max_connections": max_connections, "request_timeout_s": 1.0}
    if max_connections is None:  # the defaults: 64 idle connections fit under the cap
        bounds = {}
    before = _served_threads()
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY, **bounds) as handle:
        host, port = handle.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(64)]
        try:
            time.sleep(0.3)
            cap = handle._server.max_connections
            assert _served_threads() - before <= cap
            status, took = _request_with_retries(handle.url, within_s=5)
            assert status == 200 and took < 5
        finally:
            for connection in idle:
                connection.close()
