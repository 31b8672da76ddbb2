"""`grpo serve`: the PyTRIO service on localhost, backed by the embedded local backend.

pytrio 0.2.9's own, unchanged client (and so any PyTRIO program) runs against it offline:
start ``grpo serve``, then run the program with ``PYTRIO_BASE_URL`` and ``PYTRIO_API_KEY``
set as it prints. The wire protocol is the part of PyTRIO's that the SDK's
``ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient`` use:

- Control API, JSON under ``<base>/api/``: API-key verify, SDK bootstrap, the model
  catalogue, service sessions, training and sampling runs (create, get, list, renew,
  restore binding), checkpoints (list, download URL, delete); telemetry is accepted and
  dropped.
- Actor API under ``<base>/actor/``: ``POST v1/events`` (msgpack envelopes),
  ``GET v1/events/{id}`` (long-polled, ``Prefer: wait=N``), ``POST v1/client/heartbeat``
  and ``POST v1/sampling-runs/{id}/sample`` (JSON).

What each operation does is `serve_state`'s business (`serve_wire` converts, `serve_routes`
maps paths to operations); this module is the HTTP shell: dispatch, authentication
(``--api-key``: a request without it gets 401), fault injection (`serve_faults`) and error
statuses. A request the backend refuses is a 4xx (or a failed
event) that the SDK raises at once, never a 5xx it would retry for 15 minutes.

The server is the standard library's ``ThreadingHTTPServer`` (HTTP/1.1, keep-alive, one
thread per connection): the SDK keeps a few connections open and every request is either
short or a long poll, so it needs no more; pytrio's own msgpack encodes the events.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgpack

from grpo.backends.local import LocalServiceClient, default_root
from grpo.serve.faults import FaultPlan, parse_fault
from grpo.serve.routes import (
    OPERATIONS,
    Reply,
    Request,
    Route,
    error_body,
    event_operation,
    routes,
)
from grpo.serve.state import ServeState
from grpo.serve.wire import ServeError

DEFAULT_PORT = 8765


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        api_key: str | None,
        faults: FaultPlan,
        log_requests: bool,
    ) -> None:
        super().__init__(address, _Handler)
        self.api_key = api_key
        self.faults = faults
        self.log_requests = log_requests
        self.stopping = threading.Event()
        self.state: ServeState | None = None
        self.routes: list[Route] = []


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (~40 ms)
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.log_requests:
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802 - stdlib names
        self._handle()

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle()

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        request = Request(self.command, parts.path, query, self.headers, body)
        wants_msgpack = "application/msgpack" in (self.headers.get("Accept") or "")
        try:
            reply = self._route(request)
        except ServeError as error:
            reply = Reply(error.status, error_body(error.code, error.message, request.path))
        except Exception as error:  # noqa: BLE001 - an unexpected bug is a 500, logged here
            traceback.print_exc(file=sys.stderr)
            reply = Reply(
                500, error_body("internal_error", f"{type(error).__name__}: {error}", request.path)
            )
        if reply.status >= 400 and wants_msgpack:
            reply.msgpack = True
        self._send(reply)

    def _route(self, request: Request) -> Reply:
        for method, pattern, operation, auth, handler in self.server.routes:
            match = pattern.fullmatch(request.path)
            if match is None or method != request.method:
                continue
            self._authorize(auth, request)
            if operation:
                self._inject_fault(operation if operation != "submit" else event_operation(request))
            return handler(self.server.state, request, *match.groups())
        raise ServeError(404, "not_found", f"no route for {request.method} {request.path}")

    def _authorize(self, auth: str, request: Request) -> None:
        key = self.server.api_key
        bearer = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if auth == "files":
            if request.query.get("token") != self.server.state.download_token:
                raise ServeError(403, "forbidden", "the download token is missing or wrong")
        elif key is None or auth == "none":
            return
        elif auth == "control" and key not in (request.headers.get("X-API-Key"), bearer):
            raise ServeError(
                401,
                "unauthorized",
                "missing or wrong API key; set PYTRIO_API_KEY to the key "
                "given to `grpo serve --api-key`",
            )
        elif auth == "actor" and bearer not in self.server.state.actor_tokens:
            raise ServeError(401, "unauthorized", "missing or unknown actor token")

    def _inject_fault(self, operation: str) -> None:
        status, delay = self.server.faults.decide(operation)
        if delay > 0:
            time.sleep(delay)
        if status is not None:
            code = "too_many_requests" if status == 429 else "service_unavailable"
            raise ServeError(status, code, f"injected fault: {operation} -> HTTP {status}")

    def _send(self, reply: Reply) -> None:
        if isinstance(reply.body, bytes):
            payload, content_type = reply.body, "application/octet-stream"
        elif reply.body is None:
            payload, content_type = b"", "application/json"
        elif reply.msgpack:
            payload, content_type = (
                msgpack.packb(reply.body, use_bin_type=True),
                "application/msgpack",
            )
        else:
            payload, content_type = json.dumps(reply.body).encode(), "application/json"
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


# --- public API ----------------------------------------------------------------------------


class ServeHandle:
    """A running server: `url` (PYTRIO_BASE_URL), `state`, `faults`; `close()` stops it."""

    def __init__(
        self, server: _Server, local: LocalServiceClient, thread: threading.Thread | None
    ) -> None:
        self._server, self._local, self._thread = server, local, thread
        host, port = server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.state: ServeState = server.state  # type: ignore[assignment]
        self.faults = server.faults

    def close(self) -> None:
        """Stop serving, end long polls, free the port and the local backend's worker."""
        self._server.stopping.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._local.close()

    def __enter__(self) -> ServeHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_server(
    *,
    root: str | Path | None = None,
    api_key: str | None = None,
    faults: FaultPlan | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    log_requests: bool = False,
    aliases: dict[str, str] | None = None,
    sampler_dtype: str = "float32",
) -> tuple[_Server, LocalServiceClient]:
    """A bound, not yet serving server on a local backend under `root`; port 0 = any free port."""
    server = _Server(
        (host, port), api_key=api_key, faults=faults or FaultPlan(), log_requests=log_requests
    )
    root_path = Path(root) if root is not None else default_root()
    local = LocalServiceClient(root=root_path, seed=seed, sampler_dtype=sampler_dtype)
    bound_host, bound_port = server.server_address[:2]
    base = f"http://{bound_host}:{bound_port}"
    try:
        server.state = ServeState(
            local, root_path, f"{base}/actor", files_url=f"{base}/files", aliases=aliases
        )
    except BaseException:
        server.server_close()
        local.close()
        raise
    server.routes = routes(server.stopping)
    return server, local


def serve_in_thread(
    *,
    root: str | Path | None = None,
    api_key: str | None = None,
    faults: FaultPlan | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    aliases: dict[str, str] | None = None,
    sampler_dtype: str = "float32",
) -> ServeHandle:
    """Serve on a daemon thread (for tests and notebooks); close the handle to stop.

    `aliases` maps model names a program asks for to served models (``--model-alias``);
    `sampler_dtype` "bfloat16" samples in reduced precision (a sampler-trainer mismatch).
    """
    server, local = start_server(
        root=root,
        api_key=api_key,
        faults=faults,
        host=host,
        port=port,
        seed=seed,
        aliases=aliases,
        sampler_dtype=sampler_dtype,
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="grpo-serve", daemon=True
    )
    thread.start()
    return ServeHandle(server, local, thread)


@contextlib.contextmanager
def configured_pytrio(
    url: str, *, api_key: str, home: str | Path, **options: Any
) -> Iterator[None]:
    """pytrio pointed at `url` (its home at `home`, telemetry off, `options` passed to
    `pytrio.configure`) for clients created inside the block; its settings restored after.

    At exit the block's clients are shut down (their service sessions closed) while the
    server still answers: a pytrio client collected after its server is gone would retry
    closing its session for 15 minutes.
    """
    import gc

    import pytrio
    from pytrio.config import config as pytrio_config
    from pytrio.runtime.service import cancel_active_service_runtimes

    saved = pytrio_config.configuration.model_copy(deep=True)
    auth = pytrio_config.auth_state
    saved_auth = (auth.api_key, auth.config_error)
    pytrio.configure_observability(enabled=False)
    pytrio.configure(home=str(home), base_url=url, api_key=api_key, **options)
    try:
        yield
    finally:
        gc.collect()
        cancel_active_service_runtimes()
        for field in type(saved).model_fields:
            setattr(pytrio_config.configuration, field, getattr(saved, field))
        auth.api_key, auth.config_error = saved_auth
        pytrio.configure_observability(enabled=True)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `grpo serve` options."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0 picks a free one)")
    parser.add_argument(
        "--root", default=None, help=f"checkpoint directory (default: {default_root()})"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require this API key (default: accept any non-empty key); also read from "
        "$GRPO_SERVE_API_KEY so that it stays out of the process list",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds LoRA init / sampling when a call gives none"
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="OP:ACTION[:WHEN]",
        help="inject a transient fault, e.g. sample:503:first=2 or forward_backward:"
        "delay=0.5:every=3 (WHEN: first=N, every=K, calls=1,4, p=0.25); operations: "
        + ", ".join(OPERATIONS)
        + ", or * for all",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="serve MODEL (e.g. grpo's built-in one) under NAME too, so that a program asking "
        "for NAME (e.g. Qwen/Qwen3.5-4B) runs unchanged; repeatable",
    )
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of p=... faults")
    parser.add_argument(
        "--sampler-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="sample in this precision while training stays float32 (bfloat16 reproduces a "
        "real service's sampler-trainer mismatch; default float32)",
    )
    parser.add_argument("--log-requests", action="store_true", help="log every request to stderr")


def _parse_alias(spec: str) -> tuple[str, str]:
    alias, separator, name = spec.partition("=")
    if not (alias and separator and name):
        raise ValueError(
            f"--model-alias {spec!r}: expected NAME=MODEL, e.g. Qwen/Qwen3.5-4B=grpo/..."
        )
    return alias, name


def run_serve(args: argparse.Namespace, *, echo: Callable[[str], None] = print) -> int:
    """Serve until Ctrl-C (or SIGTERM); prints the URL and the environment variables to set."""
    import os

    api_key = args.api_key or os.environ.get("GRPO_SERVE_API_KEY") or None
    try:
        faults = FaultPlan([parse_fault(spec) for spec in args.fault], seed=args.fault_seed)
        aliases = dict(_parse_alias(spec) for spec in args.model_alias)
    except ValueError as error:
        echo(f"grpo serve: {error}")
        return 2
    try:
        server, local = start_server(
            root=args.root,
            api_key=api_key,
            faults=faults,
            host=args.host,
            port=args.port,
            seed=args.seed,
            log_requests=args.log_requests,
            aliases=aliases,
            sampler_dtype=args.sampler_dtype,
        )
    except ValueError as error:
        echo(f"grpo serve: {error}")
        return 2
    except OSError as error:
        echo(
            f"grpo serve: cannot listen on {args.host}:{args.port}: {error}; "
            "pick another --port (0 = any)"
        )
        return 1
    handle = ServeHandle(server, local, None)
    key_hint = (
        "<the key given to --api-key>" if api_key else "local   # any non-empty key is accepted"
    )
    echo(
        f"grpo serve: PyTRIO service on {handle.url} "
        f"(local backend; checkpoints in {handle.state.root})"
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        echo(f"grpo serve: warning: bound to {args.host}, reachable from other machines")
    for alias, name in aliases.items():
        echo(f"grpo serve: serving {name} as {alias!r} too")
    for spec in args.fault:
        echo(f"grpo serve: injecting fault {spec}")
    echo("In the shell that runs your PyTRIO program:")
    echo(f"  export PYTRIO_BASE_URL={handle.url}")
    echo(f"  export PYTRIO_API_KEY={key_hint}")
    echo("Ctrl-C stops the server.")
    # Ctrl-C and SIGTERM stop it, even when started in the background (SIGINT ignored there).
    previous = {
        number: signal.signal(number, signal.default_int_handler)
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        echo("grpo serve: stopping")
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        handle.close()
    return 0
