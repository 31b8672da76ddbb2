"""The local sampler's request validation: PyTRIO's checks plus the local model's limits.

``validate_sample_request`` turns a ``sample``/``compute_logprobs`` call into a
``SampleSpec`` (or raises a ``ValidationError`` naming the field) before anything is
queued; a request without a seed gets one from the service's seeded generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pytrio.errors.base import ValidationError
from pytrio.types import ImageChunk, ModelInput, SamplingParams

from grpo.backends.local.sample_request import SampleSpec


def _invalid(message: str, **details: object) -> ValidationError:
    return ValidationError(message, code="validation.invalid_sampling_request", details=details)


def validate_sample_request(
    prompt: ModelInput,
    *,
    num_samples: int,
    sampling_params: SamplingParams,
    include_prompt_logprobs: bool,
    topk_prompt_logprobs: int,
    return_text: bool,
    vocab_size: int,
    max_positions: int,
    draw_seed: Callable[[], int],
    generate: bool = True,
) -> SampleSpec:
    """PyTRIO's sampling checks plus the local model's limits; ValidationError names the field.

    A request without ``sampling_params.seed`` gets one from ``draw_seed`` (the service's
    seeded generator), so every sequence has its own reproducible random stream.
    """
    if prompt.is_empty:
        raise ValidationError("prompt cannot be empty", code="validation.empty_prompt")
    if any(isinstance(chunk, ImageChunk) for chunk in prompt.chunks):
        raise ValidationError(
            "the local backend samples from text prompts only; remove the image chunks",
            code="validation.image_unsupported",
        )
    params = sampling_params
    if not _is_int(params.max_tokens) or params.max_tokens <= 0:
        raise ValidationError(
            "sampling_params.max_tokens must be greater than 0",
            code="validation.invalid_sampling_request",
        )
    if not _is_int(num_samples) or num_samples < 1:
        raise _invalid(f"num_samples must be >= 1, got {num_samples!r}", num_samples=num_samples)
    if not _is_int(topk_prompt_logprobs) or topk_prompt_logprobs < 0:
        raise _invalid(
            f"topk_prompt_logprobs must be >= 0, got {topk_prompt_logprobs!r}",
            topk_prompt_logprobs=topk_prompt_logprobs,
        )
    temperature = float(params.temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise _invalid(
            f"sampling_params.temperature must be a finite number >= 0 (0 = greedy), got "
            f"{params.temperature!r}",
            temperature=params.temperature,
        )
    top_p = float(params.top_p)
    if not (0 < top_p <= 1):
        raise _invalid(
            f"sampling_params.top_p must be in (0, 1] (1 = off), got {params.top_p!r}",
            top_p=params.top_p,
        )
    if not _is_int(params.top_k) or not (params.top_k == -1 or params.top_k >= 1):
        raise _invalid(
            f"sampling_params.top_k must be -1 (off) or >= 1, got {params.top_k!r}",
            top_k=params.top_k,
        )
    if params.seed is not None and not _is_int(params.seed):
        raise _invalid(
            f"sampling_params.seed must be an int, got {params.seed!r}", seed=params.seed
        )
    tokens = tuple(prompt.to_ints())
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValidationError(
                "prompt token ID is outside the tokenizer vocabulary",
                code="validation.token_id_out_of_range",
                details={
                    "field": "prompt",
                    "token_index": index,
                    "token_id": token,
                    "vocab_size": vocab_size,
                },
            )
    new_tokens = params.max_tokens if generate else 0
    if len(tokens) + new_tokens > max_positions:
        raise ValidationError(
            f"prompt has {len(tokens)} tokens + max_tokens {new_tokens} = "
            f"{len(tokens) + new_tokens}, over the model's {max_positions} positions; "
            "shorten the prompt or lower max_tokens",
            code="validation.sampling_request_too_long",
            details={
                "prompt_tokens": len(tokens),
                "max_tokens": new_tokens,
                "max_positions": max_positions,
            },
        )
    stop_strings, stop_token_ids = _normalize_stop(params.stop, vocab_size)
    return SampleSpec(
        prompt=tokens,
        num_samples=num_samples,
        max_tokens=new_tokens,
        temperature=temperature,
        top_k=params.top_k,
        top_p=top_p,
        seed=params.seed if params.seed is not None else draw_seed(),
        stop_strings=stop_strings,
        stop_token_ids=stop_token_ids,
        include_prompt_logprobs=bool(include_prompt_logprobs),
        topk_prompt_logprobs=topk_prompt_logprobs,
        return_text=bool(return_text),
        generate=generate,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _normalize_stop(stop: object, vocab_size: int) -> tuple[tuple[str, ...], frozenset[int]]:
    """PyTRIO's rule: a string, a list of strings, or a list of token ids."""
    if stop is None:
        return (), frozenset()
    items = [stop] if isinstance(stop, str) else list(stop)  # type: ignore[call-overload]
    if items and all(_is_int(item) for item in items):
        bad = [item for item in items if not 0 <= item < vocab_size]
        if bad:
            raise _invalid(
                f"sampling_params.stop token id {bad[0]} is outside the vocabulary "
                f"[0, {vocab_size})",
                stop=bad[0],
            )
        return (), frozenset(items)
    if not all(isinstance(item, str) and item for item in items):
        raise _invalid(
            f"sampling_params.stop must be a non-empty string, a list of non-empty strings, or "
            f"a list of token ids; got {stop!r}",
            stop=repr(stop),
        )
    return tuple(items), frozenset()
