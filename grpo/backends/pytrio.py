"""Backend selection: the PyTRIO service or the embedded local model, behind one client API.

The loop only ever sees a service client with PyTRIO's methods. This module creates it and
wraps calls that may fail transiently in bounded retries with backoff. The API key is
PyTRIO's business (its profile, `trio login`, or `PYTRIO_API_KEY`): this module never reads,
stores or logs it.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from grpo.backends.names import TINY_TOOLS_MODEL_NAME
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION

T = TypeVar("T")

DEFAULT_CONNECT_TIMEOUT_S = 30.0
PYTRIO_DEFAULT_IN_FLIGHT = 16


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot be reached or authenticated; the message says how to fix it."""


class CapabilityError(ValueError):
    """The run asks more of the model than the service allows; the message names the fix."""


def is_pytrio_error(error: BaseException) -> bool:
    """Whether `error` is one of pytrio's own (its `str` appends `| Hint:`, `| Request:` ...)."""
    return type(error).__module__.startswith("pytrio") and isinstance(
        getattr(error, "message", None), str
    )


def error_reason(error: BaseException, *, hint: bool = False) -> str:
    """An error's text for a message of ours: a pytrio error's own message (with its hint
    when `hint`) without the request, context and details it appends; any other error's
    first line (its type when it has no text)."""
    if is_pytrio_error(error):
        text, advice = str(getattr(error, "message")), str(getattr(error, "hint", "") or "")
        return f"{text} (hint: {advice})" if hint and advice else text
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def make_service_client(
    backend: str,
    *,
    local_root: str | None = None,
    seed: int = 0,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    concurrency: int | None = None,
    sampler_dtype: str = "float32",
    threads: int = 0,
    service_normalization: str = DEFAULT_SERVICE_NORMALIZATION,
) -> Any:
    """A service client: `LocalServiceClient` for 'local', `pytrio.ServiceClient` for 'pytrio',
    the official Tinker SDK's behind pytrio's API for 'tinker' (`grpo.backends.tinker_sdk`).

    For 'pytrio', `concurrency` sampling requests may be in flight (see
    `configure_concurrency`), and a service that does not answer within `connect_timeout_s`
    raises `BackendUnavailableError` naming the URL (pytrio alone would retry for 15 minutes).
    `sampler_dtype`, `threads` (0 = auto) and `service_normalization` are the local backend's
    (`LocalServiceClient`).
    """
    if backend == "local":
        from grpo.backends.local import LocalServiceClient

        return LocalServiceClient(
            root=local_root,
            seed=seed,
            sampler_dtype=sampler_dtype,
            threads=threads,
            service_normalization=service_normalization,
        )
    if backend == "pytrio":
        import pytrio
        from pytrio.config.config import auth_state, configuration

        if auth_state.config_error is not None or not auth_state.api_key:
            # No key: say so at once, without asking the network anything.
            reason = auth_state.config_error or "no API key is configured"
            raise BackendUnavailableError(
                f"PyTRIO service unavailable: {reason}. Log in with `trio login` (or set "
                "PYTRIO_API_KEY), or run offline with `--backend local`."
            )
        if concurrency is not None:
            configure_concurrency(concurrency)
        wait_until_reachable(configuration.base_url, timeout_s=connect_timeout_s)
        try:
            return pytrio.ServiceClient()
        except pytrio.PyTrioError as error:
            raise BackendUnavailableError(
                f"PyTRIO service at {configuration.base_url} unavailable: "
                f"{type(error).__name__}: {error}. Log in with `trio login` (or set "
                "PYTRIO_API_KEY), or run offline with `--backend local`."
            ) from None
    if backend == "tinker":
        from grpo.backends.tinker_sdk import TinkerSetupError, make_tinker_service_client

        try:
            client = make_tinker_service_client()
        except TinkerSetupError as error:
            raise BackendUnavailableError(str(error)) from None
        wait_until_reachable(
            client.base_url, timeout_s=connect_timeout_s, service="Tinker", env_prefix="TINKER"
        )
        return client
    raise ValueError(f"--backend must be 'local', 'pytrio' or 'tinker', got {backend!r}")


def sampler_on_weights(
    service: Any, base_model: str, path: str, refused: Callable[[str], Exception]
) -> Any:
    """A sampler on the sampler weights at ``path``, else on the weights of the training
    state at ``path``; when it is neither, ``refused(reason)`` is raised (the reason is the
    training state's error, in `error_reason`'s words)."""
    try:
        return service.create_sampling_client(base_model=base_model, model_path=path)
    except Exception:  # noqa: BLE001 - not sampler weights: try it as a training state
        pass
    try:
        training = service.create_training_client_from_state(path)
        return training.save_weights_and_get_sampling_client()
    except Exception as error:  # noqa: BLE001 - the caller's message says what it must be
        raise refused(error_reason(error)) from None


def wait_until_reachable(
    base_url: str,
    *,
    timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    service: str = "PyTRIO",
    env_prefix: str = "PYTRIO",
) -> None:
    """Return once `base_url` answers HTTP (any status); else BackendUnavailableError after
    `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            probe_timeout = max(0.1, min(5.0, remaining))
            with urllib.request.urlopen(base_url.rstrip("/") + "/", timeout=probe_timeout):
                return
        except urllib.error.HTTPError:
            return  # an HTTP error status is an answer: the service is there
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() + 0.5 >= deadline:
                reason = getattr(error, "reason", error)
                raise BackendUnavailableError(
                    f"{service} service at {base_url} is unreachable (no answer within "
                    f"{timeout_s:g} s: {reason}). Check {env_prefix}_BASE_URL and the network; "
                    f"for an offline service start `grpo serve` and set the {env_prefix}_BASE_URL "
                    f"and {env_prefix}_API_KEY it prints; or train offline with `--backend local`."
                ) from None
            time.sleep(0.5)


def configure_concurrency(concurrency: int) -> None:
    """Let pytrio keep `concurrency` sampling requests in flight (its default: 16).

    pytrio copies its configuration when a `ServiceClient` is created: call this before.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"--concurrency must be an int >= 1, got {concurrency!r}")
    import pytrio

    pytrio.configure(
        sampling_request_max_in_flight=concurrency,
        sampling_request_queue_capacity=max(64, concurrency),
    )


def check_capabilities(
    service_client: Any, base_model: str, max_prompt_tokens: int, max_tokens: int
) -> None:
    """Raise CapabilityError unless prompt + max_tokens fits the model's context and limits.

    The limit is the smallest of the model's context length and its sampling and training
    `max_seq_len`, as `get_server_capabilities()` reports them. A local model directory
    or the built-in tool-use model that the service does not list is not checked (the local
    backend checks it itself).
    """
    capabilities = service_client.get_server_capabilities()
    models = {model.model_name: model for model in capabilities.supported_models}
    model = models.get(base_model)
    if model is None:
        if Path(base_model).expanduser().is_dir() or base_model == TINY_TOOLS_MODEL_NAME:
            return  # the local backend checks these itself
        raise CapabilityError(
            f"--base-model {base_model!r} is not served by this service; it serves {sorted(models)}"
        )
    limits = [
        value
        for value in (
            model.max_context_length,
            # Tinker's capabilities report the context length alone.
            getattr(getattr(model, "sampling", None), "max_seq_len", None),
            getattr(getattr(model, "training", None), "max_seq_len", None),
        )
        if value is not None
    ]
    if not limits:
        return
    limit = min(limits)
    if max_prompt_tokens + max_tokens > limit:
        fits = limit - max_prompt_tokens
        fix = (
            f"lower --max-tokens to {fits} or shorten the prompts"
            if fits > 0
            else "shorten the prompts (fewer few-shot examples) or pick a longer-context model"
        )
        raise CapabilityError(
            f"the longest prompt ({max_prompt_tokens} tokens) + --max-tokens {max_tokens} = "
            f"{max_prompt_tokens + max_tokens} tokens exceeds {base_model}'s limit of {limit} "
            f"(context length / max_seq_len from get_server_capabilities); {fix}"
        )


def is_transient(error: BaseException) -> bool:
    """Whether a failed call may succeed if retried (network trouble, a retryable service error)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if type(error).__module__.startswith("tinker"):
        from grpo.backends.tinker_sdk import is_tinker_transient

        return is_tinker_transient(error)
    return bool(getattr(error, "retryable", False))


class RetriesExhaustedError(RuntimeError):
    """A call kept failing transiently after the allowed retries."""


def call_with_retries(
    call: Callable[[], T],
    *,
    what: str,
    max_retries: int,
    base_delay_s: float = 1.0,
    note: Callable[[str], None] | None = None,
) -> T:
    """Run `call`; on a transient failure retry up to `max_retries` times, with backoff."""
    for attempt in range(max_retries + 1):
        try:
            return call()
        except Exception as error:
            if not is_transient(error):
                raise
            if attempt == max_retries:
                raise RetriesExhaustedError(
                    f"{what} failed {max_retries + 1} times; last error: "
                    f"{type(error).__name__}: {error}"
                ) from error
            delay = base_delay_s * 2**attempt
            if note is not None:
                note(
                    f"{what} failed ({type(error).__name__}: {error}); "
                    f"retry {attempt + 1}/{max_retries} in {delay:.1f}s"
                )
            time.sleep(delay)
    raise AssertionError("unreachable")
