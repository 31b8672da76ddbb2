"""What the rollout path asks of the clients it is given: a tokenizer and a sampler.

Structural types (`typing.Protocol`), so a Hugging Face tokenizer, pytrio's
``SamplingClient``, the local backend's and a test's double all fit without a wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pytrio.types import ModelInput, SamplingParams


class Tokenizer(Protocol):
    """What the rollout path asks of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **options: Any) -> str: ...

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
        **options: Any,
    ) -> Any: ...

    def compute_logprobs(self, prompt: ModelInput) -> Any: ...
