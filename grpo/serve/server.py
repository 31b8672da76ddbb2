"""`grpo serve` in a program: start a server on the local backend, serve it on a thread, stop it.

pytrio 0.2.9's own, unchanged client (and so any PyTRIO program) runs against it offline;
`grpo.serve.client.configured_pytrio` points pytrio at one for the clients of a block.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from grpo.backends.local import LocalServiceClient, default_root
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION
from grpo.serve.access import checked_api_key
from grpo.serve.endpoints import ServeState
from grpo.serve.events import TrainerEvents
from grpo.serve.faults import FaultPlan
from grpo.serve.handler import HTTPServer
from grpo.serve.limits import MAX_CONNECTIONS, MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S
from grpo.serve.models import ModelCatalogue
from grpo.serve.registry import RunRegistry
from grpo.serve.tinker_service import SESSION_EXPIRY_S, TinkerService

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

P = ParamSpec("P")
R = TypeVar("R")


class ServeHandle:
    """A running server: `url` (PYTRIO_BASE_URL), `state` (its registry and events), `faults`;
    `close()` stops it."""

    def __init__(
        self, server: HTTPServer, local: LocalServiceClient, thread: threading.Thread | None
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
        # A connection's thread ends when its client hangs up, maybe at the interpreter's
        # exit; if it held the last reference to the state, it would free the trainers' torch
        # tensors then, and a thread that cannot retake the GIL there aborts the process.
        self._server.state = None

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
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    service_normalization: str = DEFAULT_SERVICE_NORMALIZATION,
    max_batch_size: int | None = None,
    max_tokens_per_request: int | None = None,
    threads: int = 0,
    tinker_session_expiry_s: float = SESSION_EXPIRY_S,
) -> tuple[HTTPServer, LocalServiceClient]:
    """A bound, not yet serving server on a local backend under `root`; port 0 = any free port.

    An empty or whitespace `api_key` is a ValueError (it must not turn the check off), and
    so is a `host` off loopback without a key: every route would be open to the network.
    `aliases` maps model names a program asks for to served models (``--model-alias``);
    `sampler_dtype` "bfloat16" samples in reduced precision (a sampler-trainer mismatch);
    the bounds are `grpo.serve.limits`' (``--max-request-bytes`` ...);
    `service_normalization` is the trainer's gradient scale (``--service-normalization``),
    `max_batch_size` / `max_tokens_per_request` the trainer limits advertised to clients
    (pytrio 0.2.9 splits a larger call into micro-batches), `tinker_session_expiry_s` how
    long a silent Tinker session lives (``--tinker-session-expiry``): one that long silent
    expires (`grpo.serve.tinker_service`).
    """
    api_key = checked_api_key(api_key)
    for flag, value in (
        ("--max-request-bytes", max_request_bytes),
        ("--max-connections", max_connections),
        ("--request-timeout", request_timeout_s),
        ("--max-batch-size", max_batch_size),
        ("--max-tokens-per-request", max_tokens_per_request),
        ("--tinker-session-expiry", tinker_session_expiry_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = auto), got {threads}")
    if api_key is None and host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"--host {host} makes the server reachable from other machines: give it a key "
            "(--api-key, or $GRPO_SERVE_API_KEY)"
        )
    server = HTTPServer(
        (host, port),
        api_key=api_key,
        faults=faults or FaultPlan(),
        log_requests=log_requests,
        max_request_bytes=max_request_bytes,
        max_connections=max_connections,
        request_timeout_s=request_timeout_s,
    )
    root_path = Path(root) if root is not None else default_root()
    local = LocalServiceClient(
        root=root_path,
        seed=seed,
        sampler_dtype=sampler_dtype,
        service_normalization=service_normalization,
        threads=threads,
    )
    bound_host, bound_port = server.server_address[:2]
    base = f"http://{bound_host}:{bound_port}"
    try:
        catalogue = ModelCatalogue(
            local, root_path, aliases, (max_batch_size, max_tokens_per_request)
        )
        registry = RunRegistry(catalogue, f"{base}/actor", files_url=f"{base}/files")
    except BaseException:
        server.server_close()
        local.close()
        raise
    server.state = ServeState(
        registry,
        TrainerEvents(registry, server.stopping),
        TinkerService(registry, server.stopping, session_expiry_s=tinker_session_expiry_s),
    )
    return server, local


def _taking_the_arguments_of(
    source: Callable[P, object],
) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Mark the decorated function as taking `source`'s arguments, for type checkers and for
    ``inspect.signature`` (it passes them on to `source`: one signature, one set of defaults)."""

    def decorate(function: Callable[..., R]) -> Callable[P, R]:
        returns = inspect.signature(function).return_annotation
        signature = inspect.signature(source).replace(return_annotation=returns)
        function.__signature__ = signature  # type: ignore[attr-defined]
        return cast("Callable[P, R]", function)

    return decorate


@_taking_the_arguments_of(start_server)
def serve_in_thread(**options: Any) -> ServeHandle:
    """`start_server(**options)`, served on a daemon thread (for tests and notebooks); close
    the handle to stop."""
    server, local = start_server(**options)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="grpo-serve", daemon=True
    )
    thread.start()
    return ServeHandle(server, local, thread)
