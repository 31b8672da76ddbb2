"""The HTTP shell of `grpo serve`: dispatch, authentication, fault injection, error statuses.

`HTTPServer` is the standard library's ``ThreadingHTTPServer`` (HTTP/1.1, keep-alive, one
thread per connection): the SDK keeps a few connections open and every request is either
short or a long poll, so it needs no more; pytrio's own msgpack encodes the events.

A request is matched against `grpo.serve.routes.ROUTES`, authorized (``--api-key``: a
request without it gets 401), given its injected fault if one is due
(`grpo.serve.faults`), then answered by its endpoint. A request the backend refuses is a
4xx (or a failed event) that the SDK raises at once, never a 5xx it would retry for 15
minutes; only a bug is a 500 (its traceback goes to stderr).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgpack

from grpo.serve.endpoints import ServeState
from grpo.serve.faults import FaultPlan
from grpo.serve.messages import Reply, Request, error_body
from grpo.serve.routes import ROUTES
from grpo.serve.wire import ServeError


class HTTPServer(ThreadingHTTPServer):
    """The server: its API key, fault plan and `ServeState` (set once built)."""

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
        self.stopping = threading.Event()  # set at close: long polls answer at once
        self.state: ServeState | None = None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (~40 ms)
    server: HTTPServer

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
        for route in ROUTES:
            ids = route.match(request)
            if ids is None:
                continue
            self._authorize(route.auth, request)
            operation = route.fault_operation(request)
            if operation:
                self._inject_fault(operation)
            return route.handler(self.server.state, request, *ids)
        raise ServeError(404, "not_found", f"no route for {request.method} {request.path}")

    def _authorize(self, auth: str, request: Request) -> None:
        key = self.server.api_key
        bearer = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if auth == "files":
            if request.query.get("token") != self.server.state.registry.download_token:
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
        elif auth == "actor" and bearer not in self.server.state.registry.actor_tokens:
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
