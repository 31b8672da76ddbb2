"""`--backend tinker`: the official `tinker` SDK behind the PyTRIO-shaped client API the loop uses.

Tinker's API is PyTRIO's in all but its types, so the adaptor is thin: each call's pytrio
`Datum`/`ModelInput`/`SamplingParams`/`AdamParams` becomes the SDK's own (same fields), and
everything the SDK returns (futures, `ForwardBackwardOutput`, `SampleResponse`, checkpoint
paths ``tinker://...``) already reads as the loop expects. Two conversions carry meaning:

- a target ``IGNORE_INDEX`` (the prompt, `grpo.backends.datums.batch_to_datums`) becomes the
  token that really follows, with a zero weight input: Tinker trains every target it is sent
  and weighs it by its advantage (or weight), so the gradient is the same and no service sees a
  negative token id;
- Tinker's built-in losses are sums over tokens (no divisor), so the run pre-scales for ``sum``
  (`grpo.core.normalization.service_divisor`), unless --service-normalization says the
  service divides.

The SDK reads ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` itself; this module only checks that
they are set, and never stores, logs or repeats the key.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grpo.backends.datums import IGNORE_INDEX
from grpo.backends.names import BUILTIN_MODEL_NAMES

BASE_URL_ENV = "TINKER_BASE_URL"
API_KEY_ENV = "TINKER_API_KEY"
INSTALL_HINT = 'pip install -e ".[tinker]"'
CLOSE_TIMEOUT_S = 10.0
EXIT_FINISH_TIMEOUT_S = 2.0
WEIGHT_INPUTS = ("advantages", "weights")


class TinkerSetupError(RuntimeError):
    """The SDK is missing or its settings are; the message says how to fix it (never the key)."""


def import_sdk() -> Any:
    """The `tinker` module, or TinkerSetupError naming the extra that installs it."""
    try:
        import tinker
    except ImportError:
        raise TinkerSetupError(
            f"--backend tinker needs the official Tinker SDK: {INSTALL_HINT} (tinker==0.38.0)"
        ) from None
    return tinker


def settings_problem(environ: dict[str, str] | None = None) -> str | None:
    """What is missing from ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` (a sentence), or None."""
    env = os.environ if environ is None else environ
    missing = [name for name in (BASE_URL_ENV, API_KEY_ENV) if not env.get(name, "").strip()]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: export "
        f"{BASE_URL_ENV} (the Tinker service's URL, or the one `grpo serve` prints) and "
        f"{API_KEY_ENV} (your key; `grpo serve` prints one for itself)"
    )


def is_tinker_transient(error: BaseException) -> bool:
    """Whether an SDK error may pass if retried: a connection failure, 408, 429 or a 5xx."""
    if not type(error).__module__.startswith("tinker"):
        return False
    tinker = import_sdk()
    if isinstance(error, tinker.APIConnectionError):
        return True
    status = getattr(error, "status_code", None)
    return isinstance(status, int) and (status in (408, 429) or status >= 500)


def sdk_model_input(model_input: Any) -> Any:
    """A pytrio (or any) `ModelInput` as the SDK's, from its token ids."""
    types = import_sdk().types
    if isinstance(model_input, types.ModelInput):
        return model_input
    return types.ModelInput.from_ints(list(model_input.to_ints()))


def _tensor(types: Any, values: np.ndarray) -> Any:
    dtype = "int64" if values.dtype.kind in "iu" else "float32"
    return types.TensorData(data=values.tolist(), dtype=dtype, shape=[int(values.shape[0])])


def sdk_datum(datum: Any) -> Any:
    """A pytrio `Datum` as the SDK's: ignored targets become the next input token with a zero
    weight input (the prompt trains nothing either way)."""
    types = import_sdk().types
    if isinstance(datum, types.Datum):
        return datum
    tokens = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
    inputs = {
        key: np.asarray(tensor.data, dtype=np.int64 if key == "target_tokens" else np.float32)
        for key, tensor in datum.loss_fn_inputs.items()
    }
    targets = inputs.get("target_tokens")
    if targets is not None:
        ignored = targets == IGNORE_INDEX
        if ignored.any():
            following = np.append(tokens[1:], 0)[: targets.size]
            inputs["target_tokens"] = np.where(ignored, following, targets)
            for key in WEIGHT_INPUTS:
                if key in inputs:
                    inputs[key] = np.where(ignored, 0.0, inputs[key]).astype(np.float32)
            if "logprobs" in inputs:
                inputs["logprobs"] = np.where(ignored, 0.0, inputs["logprobs"]).astype(np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens.tolist()),
        loss_fn_inputs={key: _tensor(types, values) for key, values in inputs.items()},
    )


def sdk_datums(data: Sequence[Any]) -> list[Any]:
    """`sdk_datum` of each datum."""
    return [sdk_datum(datum) for datum in data]


def _sdk_params(params: Any, name: str) -> Any:
    if params is None:
        return None
    sdk_type = getattr(import_sdk().types, name)
    if isinstance(params, sdk_type):
        return params
    return sdk_type(**params.model_dump())


def resolved(client: Any) -> Any:
    """The client a SDK "backcompat" future stands for (the SDK deprecates using the future)."""
    import_sdk()
    from tinker.lib.public_interfaces.backcompat_client_future import BackcompatClientFuture

    return client.result() if isinstance(client, BackcompatClientFuture) else client


def tokenizer_for(model_name: str, load: Callable[[], Any]) -> Any:
    """grpo's own tokenizer for a built-in model (no hub has it), else the SDK's `load()` (by
    the model's name from the Hugging Face hub, or a local directory)."""
    if model_name.split(":")[0] in BUILTIN_MODEL_NAMES:
        from grpo.backends.local import builtin_tokenizer

        return builtin_tokenizer()
    return load()


def plain(future: Any) -> Any:
    """The `concurrent.futures.Future` under a SDK future (its own `done()` is deprecated)."""
    return future.future()


class ConvertedFuture:
    """A future whose `result` is the SDK future's, converted by `convert`."""

    def __init__(self, future: Any, convert: Callable[[Any], Any]) -> None:
        self.future, self.convert = plain(future), convert

    def result(self, timeout: float | None = None) -> Any:
        """The converted result (the SDK's errors and timeouts as they are)."""
        return self.convert(self.future.result(timeout=timeout))

    def done(self) -> bool:
        """Whether the SDK's request has finished."""
        return bool(self.future.done())


def pytrio_sample_response(response: Any) -> Any:
    """The SDK's `SampleResponse` as pytrio's (the same tokens, log-probs and stop reasons; no
    text and no token counts, which the loop then takes from the tokens)."""
    from pytrio.types import SampleResponse, SampleSequence

    sequences = [
        SampleSequence(
            tokens=[int(token) for token in sequence.tokens],
            logprobs=None if sequence.logprobs is None else [float(v) for v in sequence.logprobs],
            stop_reason=str(sequence.stop_reason),
            text=None,
        )
        for sequence in response.sequences
    ]
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs=list(response.prompt_logprobs or []),
        input_tokens=0,
        output_tokens=0,
    )


class TinkerSamplingClient:
    """A SDK `SamplingClient` with pytrio's call shapes: `sample`, `compute_logprobs`, ..."""

    def __init__(self, client: Any) -> None:
        self.client = resolved(client)

    def sample(
        self,
        prompt: Any,
        num_samples: int,
        sampling_params: Any,
        include_prompt_logprobs: bool = False,
        return_text: bool = False,
    ) -> ConvertedFuture:
        """The SDK's `sample` on the converted prompt and parameters, its response as pytrio's
        (`return_text` is pytrio's: Tinker sends tokens only, which the loop decodes)."""
        future = self.client.sample(
            prompt=sdk_model_input(prompt),
            num_samples=num_samples,
            sampling_params=_sdk_params(sampling_params, "SamplingParams"),
            include_prompt_logprobs=include_prompt_logprobs,
        )
        return ConvertedFuture(future, pytrio_sample_response)

    def compute_logprobs(self, prompt: Any) -> Any:
        """The SDK's `compute_logprobs` future (the prompt's log-probs, None first)."""
        return plain(self.client.compute_logprobs(sdk_model_input(prompt)))

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (`tokenizer_for`)."""
        return tokenizer_for(self.client.get_base_model(), self.client.get_tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class TinkerTrainingClient:
    """A SDK `TrainingClient` with pytrio's call shapes; results are the SDK's own."""

    def __init__(self, client: Any) -> None:
        self.client = resolved(client)

    def forward(self, data: Sequence[Any], loss_fn: str = "cross_entropy") -> Any:
        """The SDK's `forward` future on converted datums."""
        return plain(self.client.forward(sdk_datums(data), loss_fn))

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Any:
        """The SDK's `forward_backward` future on converted datums (Tinker sums the loss)."""
        return plain(self.client.forward_backward(sdk_datums(data), loss_fn, loss_fn_config))

    def forward_backward_custom(
        self, data: Sequence[Any], loss_fn: Callable[..., Any], **options: Any
    ) -> Any:
        """The SDK's client-side custom loss (a forward, then a cross-entropy surrogate)."""
        return plain(self.client.forward_backward_custom(sdk_datums(data), loss_fn, **options))

    def optim_step(self, adam_params: Any) -> Any:
        """The SDK's `optim_step` future with the same Adam settings."""
        return plain(self.client.optim_step(_sdk_params(adam_params, "AdamParams")))

    def save_state(self, name: str) -> Any:
        """The SDK's `save_state` future (its result's ``path`` is ``tinker://RUN/weights/...``)."""
        return plain(self.client.save_state(name))

    def save_weights_for_sampler(self, name: str) -> Any:
        """The SDK's `save_weights_for_sampler` future (``tinker://RUN/sampler_weights/...``)."""
        return plain(self.client.save_weights_for_sampler(name))

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (`tokenizer_for`)."""
        name = self.client.get_info().model_data.model_name or ""
        return tokenizer_for(name, self.client.get_tokenizer)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> Any:
        """Sampler weights saved now, as a wrapped sampling client."""
        return TinkerSamplingClient(self.client.save_weights_and_get_sampling_client(name))

    def create_sampling_client(self, model_path: str) -> Any:
        """A wrapped sampling client on saved sampler weights."""
        return TinkerSamplingClient(self.client.create_sampling_client(model_path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def finish_session(client: Any, status: str = "success") -> None:
    """Finish an SDK ServiceClient's session (its heartbeats stop, the service frees its
    clients); a service already gone, or a session it expired, is not an error."""
    try:
        client.close(status).result(timeout=CLOSE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - closing is best effort: the session expires anyway
        pass


_UNFINISHED: dict[int, tuple[Any, str]] = {}  # id(SDK client) -> it and its URL, until finished
_UNFINISHED_LOCK = threading.Lock()


@atexit.register
def _finish_sessions_at_exit() -> None:
    """Finish the sessions a program left open (the SDK never does: a service would keep
    their clients until they expired). One plain POST each: at exit the SDK's own close
    would flush telemetry through an executor that is already shut down."""
    with _UNFINISHED_LOCK:
        clients = list(_UNFINISHED.values())
        _UNFINISHED.clear()
    for client, base_url in clients:
        post_finish(client, base_url)


def post_finish(client: Any, base_url: str) -> None:
    """POST the finish of an SDK ServiceClient's session to `base_url` with the SDK's key from
    the environment (best effort, `EXIT_FINISH_TIMEOUT_S`)."""
    import httpx

    try:
        session_id = client.holder.get_session_id()
        url = f"{base_url.rstrip('/')}/api/v1/sessions/{session_id}/finish"
        key = os.environ.get(API_KEY_ENV, "")
        body = {"reason": {"type": "interrupted"}, "detail": "the program exited"}
        httpx.post(url, json=body, headers={"X-API-Key": key}, timeout=EXIT_FINISH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - best effort at exit: the session expires anyway
        pass


class TinkerServiceClient:
    """The SDK's `ServiceClient` behind pytrio's API; clients it makes are wrapped too. Its
    session is finished by `close()`, else when the program exits."""

    def __init__(self, client: Any, base_url: str) -> None:
        self.client, self.base_url = resolved(client), base_url
        with _UNFINISHED_LOCK:
            _UNFINISHED[id(self.client)] = (self.client, base_url)

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, **options: Any
    ) -> TinkerTrainingClient:
        """A LoRA training client (Adam, as grpo's loop steps it)."""
        return TinkerTrainingClient(
            self.client.create_lora_training_client(
                base_model=base_model, rank=rank, seed=seed, **options
            )
        )

    def create_training_client_from_state(self, path: str) -> TinkerTrainingClient:
        """A training client on a saved state's weights (fresh optimizer)."""
        return TinkerTrainingClient(self.client.create_training_client_from_state(path))

    def create_training_client_from_state_with_optimizer(self, path: str) -> TinkerTrainingClient:
        """A training client on a saved state's weights and Adam moments (exact resume)."""
        return TinkerTrainingClient(
            self.client.create_training_client_from_state_with_optimizer(path)
        )

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> TinkerSamplingClient:
        """A sampling client on saved sampler weights or a base model."""
        return TinkerSamplingClient(
            self.client.create_sampling_client(model_path=model_path, base_model=base_model)
        )

    def get_server_capabilities(self) -> Any:
        """The service's supported models, through the SDK's RestClient on this client's URL
        (the SDK shares one REST connection per URL and key for the life of the process)."""
        rest = import_sdk().RestClient(base_url=self.base_url, api_key=os.environ[API_KEY_ENV])
        return plain(rest.get_server_capabilities()).result()

    def close(self, status: str = "success") -> None:
        """Finish the session (its heartbeats stop), once; a service already gone is not an
        error."""
        with _UNFINISHED_LOCK:
            open_session = _UNFINISHED.pop(id(self.client), None) is not None
        if open_session:
            finish_session(self.client, status)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def make_tinker_service_client() -> TinkerServiceClient:
    """The SDK's ServiceClient on ``TINKER_BASE_URL`` with ``TINKER_API_KEY`` (read by the
    SDK), wrapped; TinkerSetupError before any request when the SDK or a setting is missing."""
    tinker = import_sdk()
    problem = settings_problem()
    if problem is not None:
        raise TinkerSetupError(f"--backend tinker: {problem}")
    try:
        return TinkerServiceClient(tinker.ServiceClient(), os.environ[BASE_URL_ENV].strip())
    except tinker.TinkerError as error:
        raise TinkerSetupError(
            f"Tinker service at {os.environ[BASE_URL_ENV]} unavailable: {type(error).__name__}"
            f": {str(error).splitlines()[0] if str(error) else ''}. Check {API_KEY_ENV}"
        ) from None
