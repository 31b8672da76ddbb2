"""The HTTP shell of `grpo serve`: dispatch, authentication, bounds, fault injection, statuses.

`HTTPServer` is the standard library's ``ThreadingHTTPServer`` (HTTP/1.1, keep-alive, one
thread per connection) with a cap on the connections served at once: the SDK keeps a few
connections open and every request is either short or a long poll. Past the cap a new
connection gets a 503 with ``Retry-After`` and is closed; every socket read times out, so
a client that sends nothing holds its slot for that long only (`grpo.serve.limits`).

A request is matched against `grpo.serve.routes.ROUTES` and authorized from its headers
(``--api-key``: a request without it gets 401; a download needs its checkpoint's token,
`grpo.serve.access`) before a byte of its body is read; then the body's declared size is
checked (411/413), the body read, its injected fault applied if one is due
(`grpo.serve.faults`), and the request answered by its endpoint. A request the backend
refuses is a 4xx (or a failed event) that the SDK raises at once, never a 5xx it would
retry for 15 minutes; only a bug is a 500 (its traceback goes to stderr).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgpack

from grpo.serve.access import same_secret
from grpo.serve.endpoints import ServeState
from grpo.serve.faults import FaultPlan
from grpo.serve.limits import (
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_S,
    body_length,
)
from grpo.serve.messages import Reply, Request, error_body
from grpo.serve.routes import ROUTES, Route
from grpo.serve.tinker_routes import TINKER_KEY_PREFIX, TINKER_PREFIX
from grpo.serve.wire import ServeError

WATCHDOG_MAX_SLEEP_S = 1.0
"""The longest the header watchdog sleeps before it looks at the server's stop flag again."""


class HeaderWatchdog:
    """One thread that runs each armed callback at its deadline unless it was disarmed first.

    Arming and disarming are a dict operation under a lock (a request's header timeout used
    to be a `threading.Timer`, a thread started per request: 3 ms each quiet, 20 ms beside a
    busy sampling worker, since starting a thread waits for it to get the GIL). The thread
    ends within `WATCHDOG_MAX_SLEEP_S` of `stopping` being set.
    """

    def __init__(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        self._condition = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._tokens = iter(range(1, 2**62))
        self._wake_at = float("inf")
        self._thread = threading.Thread(target=self._loop, name="grpo-serve-watchdog", daemon=True)
        self._thread.start()

    def arm(self, timeout_s: float, callback: Callable[[], None]) -> int:
        """Run `callback` (on the watchdog's thread) in `timeout_s` s; a token for `disarm`."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            token = next(self._tokens)
            self._armed[token] = (deadline, callback)
            if deadline < self._wake_at:  # rare: the timeout was shortened
                self._condition.notify()
        return token

    def disarm(self, token: int) -> None:
        """Forget an armed callback (a no-op when it already ran)."""
        with self._condition:
            self._armed.pop(token, None)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._condition:
                now = time.monotonic()
                due = [token for token, (deadline, _) in self._armed.items() if deadline <= now]
                callbacks = [self._armed.pop(token)[1] for token in due]
                soonest = min((deadline for deadline, _ in self._armed.values()), default=now + 1e9)
                if not callbacks:
                    self._wake_at = min(max(soonest, now + 0.01), now + WATCHDOG_MAX_SLEEP_S)
                    self._condition.wait(self._wake_at - now)
                    self._wake_at = float("inf")
            for callback in callbacks:
                callback()


class HTTPServer(ThreadingHTTPServer):
    """The server: its API key, fault plan, bounds and `ServeState` (set once built)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        api_key: str | None,
        faults: FaultPlan,
        log_requests: bool,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        super().__init__(address, _Handler)
        self.header_timeout_s = header_timeout_s
        self.api_key = api_key
        self.faults = faults
        self.log_requests = log_requests
        self.max_request_bytes = max_request_bytes
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.stopping = threading.Event()  # set at close: long polls answer at once
        self.watchdog = HeaderWatchdog(self.stopping)
        self.state: ServeState | None = None

    def server_close(self) -> None:
        """Close the listening socket and end the header watchdog's thread."""
        self.stopping.set()
        super().server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread if a slot is free, else answer 503 and close it."""
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """The connection's thread; its slot is freed when the connection ends."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, connection: socket.socket) -> None:
        message = (
            f"the server already serves {self.max_connections} connections "
            "(grpo serve --max-connections); retry shortly"
        )
        payload = json.dumps(error_body("service_unavailable", message, "")).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        )
        try:
            connection.settimeout(1.0)  # the accept loop never waits on a slow client
            connection.sendall(head.encode() + payload)
        except OSError:
            pass  # the client is gone or not reading: closing is all that is left
        self.shutdown_request(connection)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (~40 ms)
    server: HTTPServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # every socket read times out
        self._watchdog: int | None = None
        super().setup()

    def handle_one_request(self) -> None:
        """One request; from its first byte, its headers must arrive within the header
        timeout, else the connection is dropped and its slot freed (a client trickling
        them a byte at a time would reset the per-read timeout for ever)."""
        try:
            if not self.rfile.peek(1):  # type: ignore[attr-defined]
                self.close_connection = True
                return
        except OSError:  # the per-read timeout while idle, or a reset
            self.close_connection = True
            return
        watchdog = self.server.watchdog
        self._watchdog = watchdog.arm(self.server.header_timeout_s, self._drop_connection)
        try:
            super().handle_one_request()
        except ConnectionError:  # a reset mid-request: end the connection, no stdlib traceback
            self.close_connection = True
        finally:
            watchdog.disarm(self._watchdog)

    def parse_request(self) -> bool:
        """The stdlib's parse of the request line and headers; the header timeout ends here."""
        try:
            return super().parse_request()
        finally:
            if self._watchdog is not None:
                self.server.watchdog.disarm(self._watchdog)

    def _drop_connection(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

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

    def do_PUT(self) -> None:  # noqa: N802 - no route takes PUT: a 405, not the stdlib's 501
        self._handle()

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        request = Request(self.command, parts.path, query, self.headers, b"")
        wants_msgpack = "application/msgpack" in (self.headers.get("Accept") or "")
        self._body_read = False
        try:
            reply = self._route(request)
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # the body did not arrive in time: nobody to answer
            return
        except ServeError as error:
            reply = Reply(error.status, error_body(error.code, error.message, request.path))
        except Exception as error:  # noqa: BLE001 - an unexpected bug is a 500, logged here
            traceback.print_exc(file=sys.stderr)
            reply = Reply(
                500, error_body("internal_error", f"{type(error).__name__}: {error}", request.path)
            )
        if reply.status >= 400 and wants_msgpack:
            reply.msgpack = True
        if not self._body_read and _declares_body(self.headers):
            self.close_connection = True  # an unread body would be taken for the next request
        self._send(reply)

    def _route(self, request: Request) -> Reply:
        # Read once: `ServeHandle.close` may drop the state while this request is in flight.
        state = self.server.state
        if state is None:  # closed: a kept-alive connection is hung up, as a gone server's
            raise ConnectionAbortedError("the server has stopped")
        route, ids = _find_route(request)
        self._authorize(route.auth, request, ids, state)
        length = body_length(request.method, request.headers, self.server.max_request_bytes)
        request.body = self.rfile.read(length) if length else b""
        if len(request.body) < length:
            raise ConnectionResetError("the client closed the connection mid-body")
        self._body_read = True
        operation = route.fault_operation(request)
        if operation:
            self._inject_fault(operation)
        return route.handler(state, request, *ids)

    def _authorize(
        self, auth: str, request: Request, ids: tuple[str, ...], state: ServeState
    ) -> None:
        key = self.server.api_key
        bearer = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if auth == "files":
            state.registry.downloads.check(ids[0], request.query.get("token"))
        elif key is None or auth == "none":
            return
        elif auth == "control" and not (
            same_secret(request.headers.get("X-API-Key"), key)
            | same_secret(request.headers.get("X-API-Key"), TINKER_KEY_PREFIX + key)
            | same_secret(bearer, key)
        ):
            variable = (
                f"TINKER_API_KEY to {TINKER_KEY_PREFIX}KEY (the SDK wants that prefix), KEY"
                if request.path.startswith(TINKER_PREFIX)
                else "PYTRIO_API_KEY to the key"
            )
            raise ServeError(
                401,
                "unauthorized",
                f"missing or wrong API key; set {variable} given to `grpo serve --api-key`",
            )
        elif auth == "actor" and bearer not in state.registry.actor_tokens:
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
            payload = reply.body
            content_type = reply.content_type or "application/octet-stream"
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
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def _find_route(request: Request) -> tuple[Route, tuple[str, ...]]:
    """The route answering `request` and the path's ids; 405 or 404 when there is none."""
    methods = []
    for route in ROUTES:
        ids = route.match(request)
        if ids is not None:
            return route, ids
        if route.path.fullmatch(request.path):
            methods.append(route.method)
    if methods:
        raise ServeError(
            405,
            "method_not_allowed",
            f"{request.method} {request.path}: this path takes {', '.join(methods)}",
        )
    raise ServeError(404, "not_found", f"no route for {request.method} {request.path:.200}")


def _declares_body(headers: Any) -> bool:
    """Whether the request's headers announce a body (chunked, or a non-zero length)."""
    length = (headers.get("Content-Length") or "0").strip()
    return bool(headers.get("Transfer-Encoding")) or length != "0"
