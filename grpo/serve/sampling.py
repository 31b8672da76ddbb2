"""Sampling in `grpo serve`: one Actor API sample request on a registered sampling run.

A request with prompt log-probs but no token log-probs is pytrio's ``compute_logprobs``;
any other samples ``num_samples`` sequences with the local sampler. Prompts are text only.
"""

from __future__ import annotations

from typing import Any

from pytrio.protocol.actor.model_input import WireEncodedTextChunk
from pytrio.protocol.actor.sampling_run.sample import SampleRequest
from pytrio.types import ModelInput

from grpo.serve.registry import RunRegistry
from grpo.serve.wire import ServeError, local_call, sampling_params


def sample(registry: RunRegistry, cuid: str, request: SampleRequest) -> dict[str, Any]:
    """`ActorSampleResponse` of one request (compute_logprobs when no token logprobs asked)."""
    client = registry.sampling_run(cuid).client
    if not all(isinstance(chunk, WireEncodedTextChunk) for chunk in request.prompt.chunks):
        raise ServeError(
            400, "validation.image_unsupported", "the local backend samples text prompts only"
        )
    tokens = [token for chunk in request.prompt.chunks for token in chunk.tokens]
    prompt = ModelInput.from_ints(tokens)
    if request.return_prompt_logprobs and not request.return_token_logprobs:
        prompt_logprobs = local_call(lambda: client.compute_logprobs(prompt).result())
        return {
            "request_id": request.request_id,
            "sampling_run": cuid,
            "sequences": [],
            "prompt_logprobs": prompt_logprobs,
            "usage": {"input_tokens": len(tokens), "output_tokens": 0},
        }
    params = sampling_params(request.sampling_params)
    response = local_call(
        lambda: client.sample(
            prompt,
            request.num_samples,
            params,
            request.return_prompt_logprobs,
            request.topk_prompt_logprobs,
            request.return_text,
        ).result()
    )
    sequences = [
        {
            "tokens": list(seq.tokens),
            "text": seq.text,
            "logprobs": list(seq.logprobs),
            "stop_reason": seq.stop_reason,
        }
        for seq in response.sequences
    ]
    return {
        "request_id": request.request_id,
        "sampling_run": cuid,
        "sequences": sequences,
        "prompt_logprobs": list(response.prompt_logprobs)
        if request.return_prompt_logprobs
        else None,
        "topk_prompt_logprobs": (
            [
                None if row is None else [list(pair) for pair in row]
                for row in response.topk_prompt_logprobs
            ]
            if request.topk_prompt_logprobs
            else None
        ),
        "usage": {
            "input_tokens": len(tokens),
            "output_tokens": sum(len(s["tokens"]) for s in sequences),
        },
    }
