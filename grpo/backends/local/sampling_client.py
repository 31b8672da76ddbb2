"""The local backend's sampling client: PyTRIO's ``SamplingClient`` on the local sampler.

``LocalSamplingClient`` samples the base model or frozen LoRA weights: it validates a
request at once (``sampler/validation.py``, and a memory estimate refused above
``SAMPLE_MEMORY_LIMIT_BYTES``) and queues it on the worker, which batches requests for
the same weights through ``sampler/loop.py``. ``read_sampler_weights`` loads the weights
of a ``save_weights_for_sampler`` checkpoint for a sampler (a ``save_state`` path is refused,
naming the way to sample it).
"""

from __future__ import annotations

import functools
import os
import uuid
from concurrent.futures import Future
from typing import Any

from pytrio.errors.base import ValidationError
from pytrio.types import APIFuture, ModelInput, SampleResponse, SamplingParams

from grpo.backends.local import checkpoint as checkpoints
from grpo.backends.local.engine import Engine
from grpo.backends.local.model import AdapterWeights, ModelHost
from grpo.backends.local.sample_request import PendingSample, SampleSpec
from grpo.backends.local.sampler.loop import sample_batch
from grpo.backends.local.sampler.validation import validate_sample_request
from grpo.backends.local.twins import awaiting_future

_DEFAULT_SAMPLING_PARAMS = SamplingParams()


def read_sampler_weights(model_path: str, host: ModelHost) -> AdapterWeights:
    """The LoRA weights saved at `model_path` by ``save_weights_for_sampler``; refused for a
    ``save_state`` path (pytrio documents ``model_path`` as "LoRA weight URI for the sampler
    to load") and unless trained on `host`'s base model."""
    directory = checkpoints.resolve(model_path)
    metadata = checkpoints.read_metadata(directory)
    if metadata.get("kind") == "state":
        raise ValidationError(
            f"model_path {model_path!r} is a training state (saved by save_state), not sampler "
            "weights: a sampler loads what save_weights_for_sampler returns; to sample a "
            "state, create_training_client_from_state(path) and then "
            "save_weights_and_get_sampling_client()",
            code="validation.not_sampler_weights",
        )
    if metadata["base_model"] != host.model_id:
        raise ValidationError(
            f"checkpoint {model_path!r} was trained on {metadata['base_model']!r}, not "
            f"{host.model_id!r}; create the sampling client with that base model",
            code="validation.checkpoint_config_mismatch",
        )
    return checkpoints.read_weights(directory, checkpoints.spec_from(metadata))


SAMPLE_MEMORY_LIMIT_BYTES = int(os.environ.get("GRPO_LOCAL_SAMPLE_MEMORY_GB", "8")) * 2**30
"""The most memory one local sample request may need (KV cache + logits), refused above it;
``GRPO_LOCAL_SAMPLE_MEMORY_GB`` changes it (default 8)."""


def sample_memory_bytes(host: ModelHost, num_samples: int, prompt_len: int, max_tokens: int) -> int:
    """Float32 bytes of a request's KV cache (2 x layers x KV heads x head dim per position of
    every sequence) plus one step's logits (vocab per sequence), an estimate within ~2x."""
    config = host.model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * heads * head_dim
    positions = prompt_len + max_tokens
    return 4 * num_samples * (per_position * positions + host.vocab_size)


def _check_sample_memory(
    host: ModelHost, num_samples: int, prompt_len: int, max_tokens: int
) -> None:
    needed = sample_memory_bytes(host, num_samples, prompt_len, max_tokens)
    if needed > SAMPLE_MEMORY_LIMIT_BYTES:
        raise ValidationError(
            f"sampling {num_samples} x {prompt_len + max_tokens} positions needs about "
            f"{needed / 2**30:.1f} GiB, over the local backend's limit of "
            f"{SAMPLE_MEMORY_LIMIT_BYTES / 2**30:.0f} GiB; lower num_samples or max_tokens "
            "(or raise GRPO_LOCAL_SAMPLE_MEMORY_GB)",
            code="validation.sample_too_large",
        )


class LocalSamplingClient:
    """In-process stand-in for `pytrio.SamplingClient`: the base model or frozen LoRA weights."""

    def __init__(self, engine: Engine, host: ModelHost, weights: AdapterWeights | None) -> None:
        self._engine = engine
        self._host = host
        self._weights = weights
        self.model_id = host.model_id
        self.end_token_ids = host.end_token_ids  # the tokens that end a turn (and a sample)
        self.max_positions = host.max_positions  # prompt + completion, at most
        self.sampling_run_cuid = f"sampler-{uuid.uuid4().hex[:12]}"
        self._run = functools.partial(
            sample_batch, host, weights, stopping=engine.worker.stopping, dtype=engine.sampler_dtype
        )

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = _DEFAULT_SAMPLING_PARAMS,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` completions of `prompt` (validated now, sampled on the worker)."""
        spec = validate_sample_request(
            prompt,
            num_samples=num_samples,
            sampling_params=sampling_params,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_text=return_text,
            vocab_size=self._host.vocab_size,
            max_positions=self._host.max_positions,
            draw_seed=self._engine.draw_seed,
        )
        _check_sample_memory(
            self._host, num_samples, len(prompt.to_ints()), sampling_params.max_tokens
        )
        return self._submit(spec)

    sample_async = awaiting_future(sample)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_t | tokens_<t) for each prompt token (None for the first)."""
        return self.score_prompt(prompt).map(lambda response: response.prompt_logprobs)

    def score_prompt(self, prompt: ModelInput, topk: int = 0) -> APIFuture[SampleResponse]:
        """`prompt`'s log-probs and, for `topk` > 0, each position's `topk` most likely tokens
        (the model's distribution at temperature 1, unfiltered); nothing is generated."""
        spec = validate_sample_request(
            prompt,
            num_samples=1,
            sampling_params=SamplingParams(max_tokens=1, seed=0),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=topk,
            return_text=False,
            vocab_size=self._host.vocab_size,
            max_positions=self._host.max_positions,
            draw_seed=self._engine.draw_seed,
            generate=False,
        )
        return self._submit(spec)

    compute_logprobs_async = awaiting_future(compute_logprobs)

    def _submit(self, spec: SampleSpec) -> APIFuture[SampleResponse]:
        key = self._weights if self._weights is not None else self._host
        return self._engine.worker.sample(key, self._run, PendingSample(spec, future=Future()))

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer."""
        return self._host.tokenizer
