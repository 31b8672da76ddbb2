"""What the rollout path asks of the clients it is given: a tokenizer and a sampler.

Structural types (`typing.Protocol`), so a Hugging Face tokenizer, pytrio's
``SamplingClient``, the local backend's and a test's double all fit without a wrapper. The
sampler is the backends' (`grpo.backends.clients`), named here for the rollout path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from grpo.backends.clients import SampledSequence, Sampler

__all__ = ["SampledSequence", "Sampler", "Tokenizer"]


class Tokenizer(Protocol):
    """What the rollout path asks of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **options: object) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...
