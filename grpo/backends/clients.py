"""What the shell asks of a backend's clients: the service, a training client, a sampler
and its tokenizer.

Structural types (`typing.Protocol`) naming only the calls grpo makes, so pytrio's clients,
the local backend's (`grpo.backends.local`), the Tinker SDK's adapters
(`grpo.backends.tinker_sdk`) and a test's double all fit without a wrapper. The results are
pytrio's records behind a `Future` (anything with ``result()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from pytrio.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

if TYPE_CHECKING:
    import torch

Note = Callable[[str], None]
"""Where a module says one line about the run (a retry, a skipped item): the run's note."""

T_co = TypeVar("T_co", covariant=True)

CustomLoss = Callable[[list[Datum], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]]
"""A local loss for ``forward_backward_custom``: (datums, per-datum logprobs) -> (loss,
metrics)."""


class Future(Protocol[T_co]):
    """A call's pending result (pytrio's ``APIFuture``, a local or converted future)."""

    def result(self) -> T_co: ...


class Tokenizer(Protocol):
    """What the rollout path asks of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **options: object) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


class SampledSequence(Protocol):
    """One sequence of a sampling response (pytrio's ``SampledSequence``)."""

    tokens: list[int]
    logprobs: list[float] | None
    text: str | None
    stop_reason: str


class Sampler(Protocol):
    """A sampling client: ``sample`` and ``compute_logprobs`` return futures (pytrio's
    ``SamplingClient``, a test's double)."""

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        **options: bool | int,
    ) -> Future[SampleResponse]: ...

    def compute_logprobs(self, prompt: ModelInput) -> Future[Sequence[float | None]]: ...

    def get_tokenizer(self) -> Tokenizer: ...


class TrainingClient(Protocol):
    """A training client: each call returns a future (pytrio's ``TrainingClient``)."""

    def forward(self, data: list[Datum], loss_fn: str = ...) -> Future[ForwardBackwardOutput]: ...

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = ...,
        loss_fn_config: dict[str, object] | None = ...,
    ) -> Future[ForwardBackwardOutput]: ...

    def forward_backward_custom(
        self, data: list[Datum], loss_fn: CustomLoss
    ) -> Future[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> Future[OptimStepResponse]: ...

    def save_state(self, name: str) -> Future[SaveWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str) -> Future[SaveWeightsForSamplerResponse]: ...

    def save_weights_and_get_sampling_client(self) -> Sampler: ...


class ServiceClient(Protocol):
    """A service client: opens training and sampling clients (pytrio's ``ServiceClient``,
    `LocalServiceClient`, `TinkerServiceClient`)."""

    def create_lora_training_client(
        self, base_model: str, rank: int = ..., seed: int | None = ...
    ) -> TrainingClient: ...

    def create_training_client_from_state(self, path: str) -> TrainingClient: ...

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient: ...

    def create_sampling_client(self, base_model: str, model_path: str | None = ...) -> Sampler: ...
