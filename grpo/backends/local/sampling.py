"""Batched sampling for the local backend: one KV-cached decode loop for many requests.

The worker hands `sample_batch` every pending request for one set of weights; all their
sequences decode together. Results do not depend on what else is in the batch:

- Each sequence owns its random stream: sample ``i`` of a request with seed ``s`` draws
  its uniforms from ``numpy.random.default_rng([s, i])`` and picks a token by inverse CDF
  of the (filtered) distribution, so no draw depends on another sequence.
- Attention never depends on the batch: prompts are left-padded into one tensor, but a
  row attends over a span fixed by its own prompt length (rounded up to `SPAN_BUCKET`,
  the extra positions masked); rows with equal spans share one masked attention call.
- Linear layers compute each row on its own when a call has a multiple of
  `ROW_MULTIPLE` rows, so every call is padded to one.

So a request with an explicit seed gives bit-identical tokens and log-probs alone or
batched with any other requests, with one thread or several (measured on this CPU build
of PyTorch; the tests check it).

Speed: for the architectures `_DecodeStep` knows (Qwen3, Qwen2, Llama), prefill and
decode run plain tensor ops over the weights with the active LoRA merged in, built once
per sampler weights and reused by every batch until other weights are sampled; other
architectures run the Hugging Face forward with the adapter. benchmarks/README.md has
the sampler's tokens/s against its compute limit.

Semantics (documented for users of the local backend):

- Log-probs are those of the distribution actually sampled from: logits / temperature,
  then top-k, renormalised, then top-p (keep the smallest head whose mass reaches p),
  renormalised. At temperature 1 with no top-k/top-p they equal a training forward's.
  Temperature 0 is greedy (first maximal token) with log-prob 0 (a point mass).
- A sequence stops at the model's end-of-turn token (``<|im_end|>``/EOS; kept in
  ``tokens``, dropped from ``text``), at a stop token id (kept in tokens and text), at a
  stop string (the token completing it is kept; ``text`` is the decode of the tokens, so
  it includes the stop string), all with ``stop_reason="stop"``; or after ``max_tokens``
  with ``stop_reason="length"``.
- ``text`` is ``tokenizer.decode(tokens, skip_special_tokens=False)`` minus a trailing
  end-of-turn token.
- Prompt log-probs use the raw (temperature 1) distribution; the first entry is None.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import cast

import attrs
import numpy as np
import torch
from pytrio.errors.base import ValidationError
from pytrio.types import ImageChunk, ModelInput, SampleResponse, SampleSequence, SamplingParams
from torch import Tensor

from grpo.backends.local.model import AdapterWeights, ModelHost, RowAttention

# A CPU matmul computes each row identically whatever the other rows when the row count is
# a multiple of 8 (measured for 1-8 threads); with fewer than 4 rows in a call, or in one
# thread's share, it switches kernels and results change in the last bits.
ROW_MULTIPLE = 8
# Prompts are aligned to spans of a multiple of this many positions: rows whose spans match
# share one attention call, and a row's span never depends on its batch. Smaller buckets
# mean fewer padded positions to prefill and attend over, but more calls; at 8, 64
# sequences of the built-in prompts (28-36 tokens) sample ~6-15% faster than at 32, and
# few-shot prompts (200+ tokens) about as fast.
SPAN_BUCKET = 8
assert SPAN_BUCKET % ROW_MULTIPLE == 0


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


@attrs.define
class PendingSample:
    """A request waiting for the worker, and the future its response goes to."""

    spec: SampleSpec
    future: Future[SampleResponse]


# --- attention over each row's own tokens ------------------------------------------------


class RowKVCache(RowAttention):
    """Per-layer key/value buffers of left-padded rows; each row's attention sees only itself.

    A row with prompt length ``n`` owns the last ``W = bucket(n)`` prompt positions of the
    cache (``n`` real tokens after ``W - n`` masked pads) plus every generated position.
    Rows are sorted by prompt length, so rows sharing a bucket form one contiguous group
    and attend in one masked attention call over exactly their own span: what a row
    computes depends on its own tokens and ``n`` only, never on the batch.
    """

    def __init__(self, prompt_lengths: Tensor, width: int, capacity: int) -> None:
        self.prompt_lengths = prompt_lengths
        self.width = width
        self.capacity = capacity
        self.length = 0
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self._prefill_masks: dict[int, Tensor] = {}
        self._decode_biases: dict[int, Tensor] = {}
        spans = _bucket(prompt_lengths)
        self.groups: list[tuple[int, int, int, Tensor]] = []
        for start, stop, span in _runs(spans):
            pads = span - prompt_lengths[start:stop]
            # Key validity over the group's whole span: pads masked, everything after valid.
            valid = torch.arange(span + capacity - width).unsqueeze(0) >= pads.unsqueeze(1)
            self.groups.append((start, stop, span, valid))

    def attend(
        self, layer_index: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
    ) -> Tensor:
        """Store this call's keys/values, then attend group by group over each row's own span."""
        query_length = query.shape[2]
        if layer_index not in self.keys:
            shape = (key.shape[0], key.shape[1], self.capacity, key.shape[3])
            self.keys[layer_index] = key.new_zeros(shape)
            self.values[layer_index] = value.new_zeros(shape)
        end = self.length + query_length
        self.keys[layer_index][:, :, self.length : end] = key
        self.values[layer_index][:, :, self.length : end] = value
        if query_length == 1:
            output = torch.empty_like(query)  # every row belongs to a group
        else:
            output = query.new_zeros(query.shape)  # positions before a row's span stay 0
        for group, (start, stop, span, valid) in enumerate(self.groups):
            first = self.width - span
            keys = self.keys[layer_index][start:stop, :, first:end]
            values = self.values[layer_index][start:stop, :, first:end]
            if query_length == 1:
                bias = self._decode_bias(group, end - first, key.shape[1])
                output[start:stop] = _decode_attention(
                    query[start:stop], keys, values, bias, scaling
                )
            else:  # the prefill: queries cover the same positions as keys
                output[start:stop, :, first:] = _attention(
                    query[start:stop, :, first:], keys, values, self._prefill_mask(group), scaling
                )
        return output.transpose(1, 2)

    def _decode_bias(self, group: int, key_length: int, kv_heads: int) -> Tensor:
        """0 at the group's valid keys, -inf at its pads: [rows * kv_heads, 1, key_length].

        Built once per decode step (the key length grows by one a step) and shared by every
        layer.
        """
        cached = self._decode_biases.get(group)
        if cached is None or cached.shape[-1] != key_length:
            _, _, _, valid = self.groups[group]
            bias = torch.zeros(valid.shape[0], kv_heads, 1, key_length)
            bias.masked_fill_(~valid[:, None, None, :key_length], -math.inf)
            cached = self._decode_biases[group] = bias.view(-1, 1, key_length)
        return cached

    def _prefill_mask(self, group: int) -> Tensor:
        """Causal over the group's span, pads hidden; a pad attends to itself so it stays finite."""
        if group not in self._prefill_masks:
            _, _, span, valid = self.groups[group]
            causal = torch.ones(span, span, dtype=torch.bool).tril()
            mask = causal & (valid[:, None, :span] | torch.eye(span, dtype=torch.bool))
            self._prefill_masks[group] = mask.unsqueeze(1)
        return self._prefill_masks[group]

    def advance(self, query_length: int) -> None:
        """Mark the positions the last model call wrote as filled."""
        self.length += query_length

    def place(self, start: int, part: RowKVCache) -> None:
        """Copy a prefilled cache of rows ``start:start + len(part rows)`` into this one."""
        stop = start + len(part.prompt_lengths)
        first = self.width - part.width
        for layer, keys in part.keys.items():
            if layer not in self.keys:
                shape = (len(self.prompt_lengths), keys.shape[1], self.capacity, keys.shape[3])
                self.keys[layer] = keys.new_zeros(shape)
                self.values[layer] = keys.new_zeros(shape)
            self.keys[layer][start:stop, :, first : self.width] = keys[:, :, : part.length]
            self.values[layer][start:stop, :, first : self.width] = part.values[layer][
                :, :, : part.length
            ]

    def select(self, rows: Tensor) -> RowKVCache:
        """A cache holding only `rows` (an ascending index, so groups stay contiguous)."""
        selected = RowKVCache(self.prompt_lengths[rows], self.width, self.capacity)
        selected.length = self.length
        selected.keys = {layer: buffer.index_select(0, rows) for layer, buffer in self.keys.items()}
        selected.values = {
            layer: buffer.index_select(0, rows) for layer, buffer in self.values.items()
        }
        return selected


def _attention(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float | None
) -> Tensor:
    """softmax(q·kᵀ·scale, masked)·v with grouped-query heads; mask is [rows, 1, q_len, keys].

    Written as two batched matmuls rather than scaled_dot_product_attention: PyTorch's
    CPU kernel splits a small decode batch across threads by keys, so a row's result
    would depend on how many rows share the call.
    """
    rows, heads, query_length, dim = query.shape
    kv_heads, key_length = keys.shape[1], keys.shape[2]
    per_kv_head = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(rows, kv_heads, per_kv_head * query_length, dim)
    scores = (grouped @ keys.transpose(-1, -2)) * scale
    scores = scores.view(rows, kv_heads, per_kv_head, query_length, key_length)
    scores = scores.masked_fill(~mask.unsqueeze(1), -math.inf)
    weights = torch.softmax(scores, dim=-1).view(
        rows, kv_heads, per_kv_head * query_length, key_length
    )
    return (weights @ values).view(rows, heads, query_length, dim)


def _decode_attention(
    query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scaling: float | None
) -> Tensor:
    """`_attention` for one query per row, the mask given as an additive bias (0 or -inf).

    bias is [rows * kv_heads, 1, keys]: a decode step runs four kernels a group and layer
    instead of six. (`baddbmm` would fold the scale and bias into the product, but its
    split across threads depends on the batch, so a row's result would too.)
    """
    rows, heads, _, dim = query.shape
    kv_heads, key_length = keys.shape[1], keys.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(rows * kv_heads, heads // kv_heads, dim)
    products = torch.bmm(grouped, keys.reshape(rows * kv_heads, key_length, dim).transpose(1, 2))
    weights = torch.softmax(torch.add(bias, products, alpha=scale), dim=-1)
    return torch.bmm(weights, values.reshape(rows * kv_heads, key_length, dim)).view(
        rows, heads, 1, dim
    )


def _bucket(prompt_lengths: Tensor) -> Tensor:
    """The span a prompt of each length owns: its length rounded up to a multiple of SPAN_BUCKET."""
    return (prompt_lengths + SPAN_BUCKET - 1) // SPAN_BUCKET * SPAN_BUCKET


def _runs(values: Tensor) -> list[tuple[int, int, int]]:
    """(start, stop, value) runs of equal values in a sorted 1-D tensor."""
    unique, counts = torch.unique_consecutive(values, return_counts=True)
    stops = counts.cumsum(0).tolist()
    starts = [0, *stops[:-1]]
    return list(zip(starts, stops, unique.tolist(), strict=True))


# --- choosing tokens ---------------------------------------------------------------------


def choose_tokens(
    logits_RV: Tensor, temperature_R: Tensor, top_k_R: Tensor, top_p_R: Tensor, uniform_R: Tensor
) -> tuple[Tensor, Tensor]:
    """Tokens by inverse CDF of u under softmax(logits/T) filtered by top-k then top-p.

    Returns the tokens and their log-probs under that filtered, renormalised distribution
    (0 for greedy rows, temperature 0). Rows never influence each other.
    """
    logits = logits_RV.to(torch.float64)
    greedy = temperature_R == 0
    scaled = logits / torch.where(greedy, 1.0, temperature_R).unsqueeze(-1)
    vocab = logits.shape[-1]
    filtered = (top_k_R < vocab) | (top_p_R < 1)
    plain = (~greedy & ~filtered).nonzero().squeeze(-1)
    if plain.numel() == len(logits):  # the usual batch: every row samples the full softmax
        return _inverse_cdf(scaled, uniform_R)

    tokens = torch.empty(len(logits), dtype=torch.long)
    chosen = torch.zeros(len(logits), dtype=torch.float64)
    if plain.numel():
        picked, picked_logprobs = _inverse_cdf(scaled[plain], uniform_R[plain])
        tokens[plain], chosen[plain] = picked, picked_logprobs

    nucleus = (~greedy & filtered).nonzero().squeeze(-1)
    if nucleus.numel():
        logprobs = torch.log_softmax(scaled[nucleus], dim=-1)
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab)
        keep = rank < top_k_R[nucleus].unsqueeze(-1)
        after_top_k = torch.where(keep, sorted_logprobs, -math.inf).log_softmax(dim=-1)
        probs = after_top_k.exp()
        keep &= (probs.cumsum(-1) - probs) < top_p_R[nucleus].unsqueeze(-1)
        position, picked_logprobs = _inverse_cdf(
            torch.where(keep, sorted_logprobs, -math.inf), uniform_R[nucleus]
        )
        tokens[nucleus] = order.gather(-1, position.unsqueeze(-1)).squeeze(-1)
        chosen[nucleus] = picked_logprobs

    greedy_rows = greedy.nonzero().squeeze(-1)
    if greedy_rows.numel():
        tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)  # log-prob stays 0
    return tokens, chosen


def _inverse_cdf(log_weights: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the first cumulative weight above u·total, and its normalised log-prob.

    `log_weights` are unnormalised log-probabilities (-inf for excluded tokens); one
    `exp` serves both the draw and the log-prob: log p_i = (w_i - max w) - log Σ e^(w - max w).
    """
    shifted = log_weights - log_weights.amax(dim=-1, keepdim=True)
    weights = shifted.exp()
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    index = torch.searchsorted(cdf, (uniform * total).unsqueeze(-1), right=True).squeeze(-1)
    # Rounding can put u·total at the very top; never land on a zero-probability tail token.
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    index = torch.minimum(index, last_positive)
    return index, shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) - total.log()


# --- the batch ---------------------------------------------------------------------------


@attrs.define
class _Row:
    """One sequence being decoded."""

    request: int
    sample_index: int
    prompt_length: int
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    stop_reason: str | None = None


class _Model:
    """The backbone + unembedding calls the sampler makes, on padded row batches.

    With `fast` (the active LoRA merged into the weights, for architectures it knows)
    prefill and decode run `_DecodeStep`; without it the Hugging Face forward, which must
    run inside ``host.sampling_weights``.
    """

    def __init__(self, host: ModelHost, fast: _DecodeStep | None) -> None:
        self.backbone = host.model.get_decoder()
        self.unembed = host.model.get_output_embeddings()
        self.layer_types = host.layer_types
        self.vocab_size = host.vocab_size
        self.fast = fast

    def hidden(self, input_ids: Tensor, position_ids: Tensor, cache: RowKVCache) -> Tensor:
        """Last hidden states [rows, q_len, hidden]; `cache` stands in for the attention mask."""
        if self.fast is not None:
            return self.fast.hidden(input_ids, position_ids, cache)
        output = self.backbone(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask={layer_type: cache for layer_type in self.layer_types},
            use_cache=False,
        )
        cache.advance(input_ids.shape[1])
        return output.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """Raw logits over the tokenizer's vocabulary (padded embedding rows are never sampled)."""
        rows = hidden.shape[0]
        hidden = torch.cat([hidden, hidden.new_zeros(_padding(rows), hidden.shape[-1])])
        unembed = self.unembed if self.fast is None else self.fast.unembedding
        return unembed(hidden)[:rows, : self.vocab_size].float()

    def decode(self, tokens_R: Tensor, positions_R: Tensor, cache: RowKVCache) -> Tensor:
        """Next-token logits [rows, vocab] after one new token per row (rows a ROW_MULTIPLE)."""
        if self.fast is not None:
            return self.fast(tokens_R, positions_R, cache)[:, : self.vocab_size].float()
        hidden = self.hidden(tokens_R.unsqueeze(-1), positions_R.unsqueeze(-1), cache)
        return self.logits(hidden[:, -1])


# Decoders whose layers are RMSNorm -> attention (optional q/k RMSNorm, RoPE) -> RMSNorm ->
# SiLU-gated MLP, as `_DecodeStep` computes them.
FAST_DECODE_MODEL_TYPES = ("qwen3", "qwen2", "llama")


def _merged_linear(module: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of a linear layer with its active, unmerged LoRA adapters added in."""
    base = getattr(module, "base_layer", module)
    weight = base.weight
    if hasattr(module, "lora_A") and not module.disable_adapters and not module.merged:
        for name in module.active_adapters:
            if name in module.lora_A:
                weight = weight + module.get_delta_weight(name)
    return weight, base.bias


def _cat_bias(biases: Sequence[Tensor | None], weights: Sequence[Tensor]) -> Tensor | None:
    """The biases of stacked linear layers as one vector (zeros for missing ones), or None."""
    if all(bias is None for bias in biases):
        return None
    return torch.cat(
        [
            bias if bias is not None else weight.new_zeros(len(weight))
            for bias, weight in zip(biases, weights)
        ]
    )


@attrs.frozen
class _LayerWeights:
    """One decoder layer, LoRA merged: fused q|k|v and gate|up projections."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    # Both per-head norms as one [heads + kv_heads, head_dim] weight, when the layer has both.
    qk_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor


@attrs.frozen
class _DecodeStep:
    """The sampler's forward (prefill and KV-cached decode) as plain tensor ops over merged weights.

    Per layer: 4 matmuls (q|k|v, o, gate|up, down) instead of 7 (plus two per LoRA
    adapter), RMSNorm as one fused op, q and k heads normed and rotated in one pass;
    attention goes through the same `RowKVCache`, so a row's result never depends on the
    batch. Same math as the Hugging Face forward, different rounding (merged LoRA, fused
    norm): log-probs agree to ~1e-6.
    """

    embed: Tensor
    layers: tuple[_LayerWeights, ...]
    final_norm: Tensor
    unembed: Tensor
    unembed_bias: Tensor | None
    rotary: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float

    @classmethod
    def build(cls, model: torch.nn.Module) -> _DecodeStep | None:
        """The merged decode step of `model` (its active adapters), or None if unsupported."""
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in FAST_DECODE_MODEL_TYPES or config.hidden_act != "silu":
            return None
        backbone = model.get_decoder()
        if not hasattr(backbone, "rotary_emb") or not hasattr(backbone, "norm"):
            return None
        layers = []
        for layer in backbone.layers:
            attention, mlp = layer.self_attn, layer.mlp
            q, q_bias = _merged_linear(attention.q_proj)
            k, k_bias = _merged_linear(attention.k_proj)
            v, v_bias = _merged_linear(attention.v_proj)
            o, o_bias = _merged_linear(attention.o_proj)
            gate, gate_bias = _merged_linear(mlp.gate_proj)
            up, up_bias = _merged_linear(mlp.up_proj)
            down, down_bias = _merged_linear(mlp.down_proj)
            if any(bias is not None for bias in (gate_bias, up_bias, down_bias)):
                return None
            q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
            layers.append(
                _LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    qkv=torch.cat([q, k, v]),
                    qkv_bias=_cat_bias([q_bias, k_bias, v_bias], [q, k, v]),
                    q_norm=None if q_norm is None else q_norm.weight,
                    k_norm=None if k_norm is None else k_norm.weight,
                    qk_norm=None
                    if q_norm is None or k_norm is None
                    else torch.cat(
                        [
                            q_norm.weight.expand(config.num_attention_heads, -1),
                            k_norm.weight.expand(config.num_key_value_heads, -1),
                        ]
                    ),
                    o=o,
                    o_bias=o_bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=torch.cat([gate, up]),
                    down=down,
                )
            )
        unembed, unembed_bias = _merged_linear(model.get_output_embeddings())
        first = backbone.layers[0].self_attn
        return cls(
            embed=backbone.embed_tokens.weight,
            layers=tuple(layers),
            final_norm=backbone.norm.weight,
            unembed=unembed,
            unembed_bias=unembed_bias,
            rotary=backbone.rotary_emb,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=first.head_dim,
            eps=backbone.norm.variance_epsilon,
            scaling=first.scaling,
        )

    def __call__(self, tokens_R: Tensor, positions_R: Tensor, cache: RowKVCache) -> Tensor:
        """Logits [rows, embedding rows] after feeding one token per row at its position."""
        hidden_R = self.hidden(tokens_R.unsqueeze(-1), positions_R.unsqueeze(-1), cache)[:, 0]
        return self.unembedding(hidden_R)

    def hidden(self, tokens_RT: Tensor, positions_RT: Tensor, cache: RowKVCache) -> Tensor:
        """Final-normed hidden states [rows, T, hidden] after feeding T tokens per row."""
        rows, length, dim = tokens_RT.shape[0], tokens_RT.shape[1], self.head_dim
        x = torch.nn.functional.embedding(tokens_RT, self.embed)
        cos, sin = self.rotary(x, positions_RT)  # [rows, T, head_dim]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        sizes = [self.heads * dim, self.kv_heads * dim, self.kv_heads * dim]
        rms_norm, linear = torch.nn.functional.rms_norm, torch.nn.functional.linear
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, x.shape[-1:], layer.input_norm, self.eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            if layer.qk_norm is not None:  # q and k heads normed and rotated together
                qk = qkv[..., : sizes[0] + sizes[1]].view(rows, length, -1, dim)
                q, k = _rotate(_head_norm(qk, layer.qk_norm, self.eps), cos, sin).split(
                    [self.heads, self.kv_heads], dim=2
                )
                v = qkv[..., sizes[0] + sizes[1] :]
            else:
                q, k, v = qkv.split(sizes, dim=-1)
                q = q.view(rows, length, self.heads, dim)
                k = k.view(rows, length, self.kv_heads, dim)
                if layer.q_norm is not None:
                    q = rms_norm(q, (dim,), layer.q_norm, self.eps)
                if layer.k_norm is not None:
                    k = rms_norm(k, (dim,), layer.k_norm, self.eps)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            v = v.reshape(rows, length, self.kv_heads, dim)
            attended = cache.attend(
                index, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scaling
            )
            x = x + linear(attended.reshape(rows, length, -1), layer.o, layer.o_bias)
            h = rms_norm(x, x.shape[-1:], layer.post_norm, self.eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(torch.nn.functional.silu(gate) * up, layer.down)
        cache.advance(length)
        return rms_norm(x, x.shape[-1:], self.final_norm, self.eps)

    def unembedding(self, hidden: Tensor) -> Tensor:
        """Logits over the embedding rows of final-normed hidden states."""
        return torch.nn.functional.linear(hidden, self.unembed, self.unembed_bias)


def _head_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis with a weight per head: x / sqrt(mean(x²) + eps) · w (float32)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _merged_step(host: ModelHost, weights: AdapterWeights | None) -> _DecodeStep | None:
    """The merged decode step of `weights` on `host`, built once per weights and reused.

    Sampler weights are frozen, so a step stays valid until other weights are sampled:
    consecutive batches of one sampling client merge the adapter once. The previous
    weights' step is dropped then (one merged copy of the matmul weights is kept).
    """
    cached = host.merged_sampler
    if cached is not None and cached[0] is weights and cached[1] is host.peft_model:
        return cast(_DecodeStep | None, cached[2])
    host.merged_sampler = None
    with host.sampling_weights(weights):
        step = _DecodeStep.build(host.model)
    host.merged_sampler = (weights, host.peft_model, step)
    return step


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of [rows, heads, head_dim] (halves rotated, as Hugging Face's)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def sample_batch(
    host: ModelHost,
    weights: AdapterWeights | None,
    pending: Sequence[PendingSample],
    *,
    stopping: threading.Event,
    dtype: torch.dtype = torch.float32,
) -> list[SampleResponse]:
    """Run every pending request in one prefill + one KV-cached decode loop.

    Raises RuntimeError between decode steps once `stopping` is set (the service stops).
    ``dtype`` bfloat16 runs the model's matmuls in bfloat16 (CPU autocast), float32 as is.
    """
    specs = [item.spec for item in pending]
    reduced = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad():
        fast = _merged_step(host, weights)
        # The merged step holds its own weights; only the Hugging Face path needs the
        # adapter loaded into the model.
        loaded = host.sampling_weights(weights) if fast is None else contextlib.nullcontext()
        with loaded, reduced:
            model = _Model(host, fast)
            prefill = _prefill(model, specs)
            rows = _decode(model, host, specs, prefill, stopping)
    responses = []
    for request, spec in enumerate(specs):
        sequences = [_sequence(row, host, spec) for row in rows if row.request == request]
        prompt_logprobs, topk = prefill.prompt_outputs(spec)
        responses.append(
            SampleResponse(
                sequences=sequences,
                prompt_logprobs=prompt_logprobs,
                topk_prompt_logprobs=topk,
                input_tokens=len(spec.prompt),
                output_tokens=sum(len(sequence.tokens) for sequence in sequences),
            )
        )
    return responses


@attrs.define
class _Prefill:
    """The prompts' KV cache, last-position logits and (when asked) prompt log-probs."""

    prompts: list[tuple[int, ...]]
    cache: RowKVCache
    last_logits: Tensor
    prompt_logprobs: dict[tuple[int, ...], Tensor]
    prompt_topk: dict[tuple[int, ...], tuple[Tensor, Tensor]]

    def prompt_outputs(
        self, spec: SampleSpec
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """SampleResponse.prompt_logprobs and topk_prompt_logprobs for one request."""
        logprobs: list[float | None] = []
        if spec.include_prompt_logprobs:
            logprobs = [None, *self.prompt_logprobs[spec.prompt].tolist()]
        topk: list[list[tuple[int, float]] | None] = []
        if spec.topk_prompt_logprobs > 0:
            values, indices = self.prompt_topk[spec.prompt]
            k = min(spec.topk_prompt_logprobs, values.shape[-1])
            topk = [None] + [
                list(zip(row_indices[:k], row_values[:k], strict=True))
                for row_indices, row_values in zip(indices.tolist(), values.tolist(), strict=True)
            ]
        return logprobs, topk


def _prefill(model: _Model, specs: Sequence[SampleSpec]) -> _Prefill:
    """Encode each distinct prompt once, one model call per span (prompts padded to their span).

    Every matmul here has rows x span token rows, a multiple of ROW_MULTIPLE, so no filler
    rows are needed; the spans' caches are then placed in one cache for the decode.
    """
    prompts = sorted({spec.prompt for spec in specs}, key=len)
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    spans = _bucket(lengths)
    width = int(spans.max())
    cache = RowKVCache(lengths, width, width + max(spec.max_tokens for spec in specs))
    want_logprobs = {spec.prompt for spec in specs if spec.include_prompt_logprobs}
    topk_by_prompt: dict[tuple[int, ...], int] = {}
    for spec in specs:
        if spec.topk_prompt_logprobs > 0:
            topk_by_prompt[spec.prompt] = max(
                spec.topk_prompt_logprobs, topk_by_prompt.get(spec.prompt, 0)
            )
    last_hidden: list[Tensor] = []
    # Position t of a prompt predicts token t + 1: n - 1 predictions per prompt.
    prediction_hidden: dict[tuple[int, ...], Tensor] = {}
    for start, stop, span in _runs(spans):
        group = prompts[start:stop]
        input_ids = torch.zeros(len(group), span, dtype=torch.long)
        position_ids = torch.zeros(len(group), span, dtype=torch.long)
        for row, prompt in enumerate(group):
            input_ids[row, span - len(prompt) :] = torch.tensor(prompt)
            position_ids[row, span - len(prompt) :] = torch.arange(len(prompt))
        part = RowKVCache(lengths[start:stop], span, span)
        hidden = model.hidden(input_ids, position_ids, part)
        cache.place(start, part)
        last_hidden.append(hidden[:, -1])
        for row, prompt in enumerate(group):
            if prompt in want_logprobs or prompt in topk_by_prompt:
                prediction_hidden[prompt] = hidden[row, span - len(prompt) : span - 1]
    cache.advance(width)
    last_logits = model.logits(torch.cat(last_hidden))

    prompt_logprobs: dict[tuple[int, ...], Tensor] = {}
    prompt_topk: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
    if prediction_hidden:
        pieces = list(prediction_hidden.values())
        all_logprobs = torch.log_softmax(model.logits(torch.cat(pieces)).to(torch.float64), dim=-1)
        offset = 0
        for prompt, piece in prediction_hidden.items():
            logprobs = all_logprobs[offset : offset + len(piece)]
            offset += len(piece)
            targets = torch.tensor(prompt[1:], dtype=torch.long)
            prompt_logprobs[prompt] = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            if prompt in topk_by_prompt:
                k = min(topk_by_prompt[prompt], logprobs.shape[-1])
                prompt_topk[prompt] = logprobs.topk(k, dim=-1)
    return _Prefill(prompts, cache, last_logits, prompt_logprobs, prompt_topk)


def _decode(
    model: _Model,
    host: ModelHost,
    specs: Sequence[SampleSpec],
    prefill: _Prefill,
    stopping: threading.Event,
) -> list[_Row]:
    """The KV-cached decode loop over every sequence of every generating request.

    Batch slot ``s`` decodes row ``slot_rows[s]``; filler slots (``filler[s]``) only pad the
    batch to a ROW_MULTIPLE and their tokens are discarded.
    """
    rows = [
        _Row(request, sample_index, len(spec.prompt))
        for request, spec in enumerate(specs)
        if spec.generate
        for sample_index in range(spec.num_samples)
    ]
    if not rows:
        return rows
    rows.sort(
        key=lambda row: row.prompt_length
    )  # stable: request and sample order kept within a length
    spec_of = [specs[row.request] for row in rows]
    slot_rows = torch.tensor(list(range(len(rows))) + [len(rows) - 1] * _padding(len(rows)))
    filler = [slot >= len(rows) for slot in range(len(slot_rows))]
    prompt_row = {prompt: row for row, prompt in enumerate(prefill.prompts)}
    source = torch.tensor([prompt_row[spec_of[row].prompt] for row in slot_rows.tolist()])
    cache = prefill.cache.select(source)
    logits = prefill.last_logits.index_select(0, source)

    temperature = torch.tensor([spec.temperature for spec in spec_of], dtype=torch.float64)
    top_k = torch.tensor([spec.top_k if spec.top_k > 0 else host.vocab_size for spec in spec_of])
    top_p = torch.tensor([spec.top_p for spec in spec_of], dtype=torch.float64)
    horizon = max(spec.max_tokens for spec in spec_of)
    uniforms = torch.from_numpy(
        np.stack(
            [
                _uniforms(spec.seed, row.sample_index, horizon)
                for spec, row in zip(spec_of, rows, strict=True)
            ]
        )
    )
    for step in range(horizon):
        if stopping.is_set():
            raise RuntimeError("the local service stopped while this request was sampling")
        tokens, logprobs = choose_tokens(
            logits,
            temperature[slot_rows],
            top_k[slot_rows],
            top_p[slot_rows],
            uniforms[slot_rows, step],
        )
        slot_list = slot_rows.tolist()
        for slot, (token, logprob) in enumerate(
            zip(tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            row = rows[slot_list[slot]]
            if filler[slot] or row.stop_reason is not None:
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.stop_reason = _stop_reason(row, spec_of[slot_list[slot]], host)
        active = [
            slot
            for slot, row in enumerate(slot_list)
            if not filler[slot] and rows[row].stop_reason is None
        ]
        if not active:
            break
        if len(active) + _padding(len(active)) <= len(slot_rows) // 2:
            # Drop finished rows, keeping a ROW_MULTIPLE of slots (finished ones become filler).
            active_set = set(active)
            spare = [slot for slot in range(len(slot_rows)) if slot not in active_set]
            keep = sorted(active + spare[: _padding(len(active))])
            cache = cache.select(torch.tensor(keep))
            slot_rows = slot_rows[keep]
            slot_list = slot_rows.tolist()
            filler = [slot not in active_set for slot in keep]
        next_tokens = torch.tensor([rows[row].tokens[-1] for row in slot_list])
        positions = torch.tensor([rows[row].prompt_length + step for row in slot_list])
        logits = model.decode(next_tokens, positions, cache)
    return rows


def _padding(rows: int) -> int:
    """How many filler rows bring `rows` (at least 1) to a multiple of ROW_MULTIPLE."""
    return -rows % ROW_MULTIPLE if rows else ROW_MULTIPLE


def _uniforms(seed: int, sample_index: int, count: int) -> np.ndarray:
    """The uniform draws of sample `sample_index` of a request seeded `seed` (its own stream)."""
    return np.random.default_rng([seed % (1 << 64), sample_index]).random(count)


def _stop_reason(row: _Row, spec: SampleSpec, host: ModelHost) -> str | None:
    """ "stop" at an end-of-turn token, a stop token id or a stop string; "length" at max_tokens."""
    token = row.tokens[-1]
    if token in host.end_token_ids or token in spec.stop_token_ids:
        return "stop"
    if spec.stop_strings:
        # A stop string completed by this token lies in the last len(stop) tokens (a token
        # decodes to at least one character); the margin covers tokens that decode to none.
        window = max(len(text) for text in spec.stop_strings) + 8
        tail = host.decoder.decode(row.tokens[-window:], skip_special_tokens=False)  # type: ignore[attr-defined]
        if any(text in tail for text in spec.stop_strings):
            return "stop"
    if len(row.tokens) >= spec.max_tokens:
        return "length"
    return None


def _sequence(row: _Row, host: ModelHost, spec: SampleSpec) -> SampleSequence:
    """The SampleSequence of a finished row (text without a trailing end-of-turn token)."""
    text = None
    if spec.return_text:
        shown = (
            row.tokens[:-1] if row.tokens and row.tokens[-1] in host.end_token_ids else row.tokens
        )
        text = host.decoder.decode(shown, skip_special_tokens=False)  # type: ignore[attr-defined]
    assert row.stop_reason is not None
    return SampleSequence(
        stop_reason=row.stop_reason, tokens=row.tokens, text=text, logprobs=row.logprobs
    )
