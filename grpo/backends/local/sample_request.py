"""A sampling request as the local backend queues it: shared by the sampler and the worker.

``SampleSpec`` is a request after validation (``sampler/validation.py``), its seed
resolved; ``PendingSample`` is a spec waiting on the worker with the future its response
goes to. Neither module owns the other's types: both depend on this one.
"""

from __future__ import annotations

from concurrent.futures import Future

import attrs
from pytrio.types import SampleResponse


@attrs.frozen
class SampleSpec:
    """A validated sampling request (what PyTRIO's SampleRequest carries), seed resolved."""

    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    include_prompt_logprobs: bool
    topk_prompt_logprobs: int
    return_text: bool
    generate: bool = True  # False: prompt log-probs only (compute_logprobs)


@attrs.define
class PendingSample:
    """A request waiting for the worker, and the future its response goes to."""

    spec: SampleSpec
    future: Future[SampleResponse]
