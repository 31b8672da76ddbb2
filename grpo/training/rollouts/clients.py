"""What the rollout path asks of the clients it is given: a tokenizer and a sampler.

The structural types of `grpo.backends.clients` (`typing.Protocol`, so a Hugging Face
tokenizer, pytrio's ``SamplingClient``, the local backend's and a test's double all fit
without a wrapper), named here for the rollout path.
"""

from __future__ import annotations

from grpo.backends.clients import SampledSequence, Sampler, Tokenizer

__all__ = ["SampledSequence", "Sampler", "Tokenizer"]
