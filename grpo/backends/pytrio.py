"""Backend selection: the PyTRIO service or the embedded local model, behind one client API.

The loop only ever sees a service client with PyTRIO's methods. This module creates it and
wraps calls that may fail transiently in bounded retries with backoff. The API key is
PyTRIO's business (its profile, `trio login`, or `PYTRIO_API_KEY`): this module never reads,
stores or logs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot be reached or authenticated; the message says how to fix it."""


def make_service_client(
    backend: str, *, local_root: str | None = None, seed: int = 0, sampler_dtype: str = "float32"
) -> Any:
    """A service client: `LocalServiceClient` for 'local', `pytrio.ServiceClient` for 'pytrio'."""
    if backend == "local":
        from grpo.backends.local import LocalServiceClient

        return LocalServiceClient(root=local_root, seed=seed, sampler_dtype=sampler_dtype)
    if backend == "pytrio":
        import pytrio

        try:
            return pytrio.ServiceClient()
        except pytrio.PyTrioError as error:
            raise BackendUnavailableError(
                f"PyTRIO service unavailable: {type(error).__name__}: {error}. "
                "Log in with `trio login` (or set the API key in the environment), "
                "or run offline with `--backend local`."
            ) from None
    raise ValueError(f"--backend must be 'local' or 'pytrio', got {backend!r}")


def is_transient(error: BaseException) -> bool:
    """Whether a failed call may succeed if retried (network trouble, a retryable service error)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    return bool(getattr(error, "retryable", False))


class RetriesExhaustedError(RuntimeError):
    """A call kept failing transiently after the allowed retries."""


def call_with_retries(
    call: Callable[[], T],
    *,
    what: str,
    max_retries: int,
    base_delay_s: float = 1.0,
    on_retry: Callable[[str], None] | None = None,
) -> T:
    """Run `call`; on a transient failure retry up to `max_retries` times with exponential backoff."""
    for attempt in range(max_retries + 1):
        try:
            return call()
        except Exception as error:
            if not is_transient(error):
                raise
            if attempt == max_retries:
                raise RetriesExhaustedError(
                    f"{what} failed {max_retries + 1} times; last error: {type(error).__name__}: {error}"
                ) from error
            delay = base_delay_s * 2**attempt
            if on_retry is not None:
                on_retry(f"{what} failed ({type(error).__name__}: {error}); retry {attempt + 1}/{max_retries} in {delay:.1f}s")
            time.sleep(delay)
    raise AssertionError("unreachable")
