"""The sampler's decode step with fewer small operations: one attention call per layer.

A decode step feeds one token per row. At the built-in model's size (hidden 128, 64 rows)
its matmuls take 10-90 us each and every other operation 2-15 us, mostly dispatch, so the
step's time depends on how many small operations it runs. ``decode_logits`` computes
what ``_DecodeStep`` computes, operation for operation on each row's values, with fewer of
them:

- attention is one call per layer over every row, not one per prompt-length span: a row's
  pads and the positions before its prompt carry a -inf bias (``DecodeCache``), which adds
  exact zeros to the softmax;
- the rotary cos/sin come from a table built once per batch (each entry is a position
  times a frequency, then cos/sin: the values ``_DecodeStep`` computes step by step), and
  q and k rotate together (``merged._rotate``);
- finished rows leave the batch as soon as a multiple of ``ROW_MULTIPLE`` slots can go, by
  moving the few active rows that sit past the new end into freed slots, not by copying
  the whole cache.

Each row's values go through the same operations as in ``_DecodeStep.hidden``; what can
differ is the rounding of the softmax's and the value product's sums over the masked
positions' exact zeros (another vector split). On the built-in model's 64 x 32 batch the
tokens and log-probs came out bit for bit those of the span-by-span decode, ~1.2x faster
(benchmarks/README.md, issue 39); the guarantee stays the one ``docs/DESIGN.md`` states.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo.backends.local.sampler.attention import RowKVCache, _padding
from grpo.backends.local.sampler.merged import _DecodeStep, _head_norm, _rotate, signed_sine


def decode_logits(
    step: _DecodeStep, tokens_R: Tensor, positions_R: Tensor, cache: DecodeCache
) -> Tensor:
    """Logits [rows, embedding rows] of `step` after feeding one new token per row."""
    rows, dim, heads, kv_heads = len(tokens_R), step.head_dim, step.heads, step.kv_heads
    qk_width = (heads + kv_heads) * dim
    linear, rms_norm, eps = torch.nn.functional.linear, torch.nn.functional.rms_norm, step.eps
    hidden = step.embed.shape[-1:]
    x = step.embed[tokens_R]
    cos, sin = cache.cos[positions_R].unsqueeze(1), cache.sin[positions_R].unsqueeze(1)
    for index, layer in enumerate(step.layers):
        qkv = linear(rms_norm(x, hidden, layer.input_norm, eps), layer.qkv, layer.qkv_bias)
        qk = qkv[:, :qk_width].view(rows, heads + kv_heads, dim)
        if layer.qk_norm is not None:
            qk = _head_norm(qk, layer.qk_norm, eps)
        elif layer.q_norm is not None or layer.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            if layer.q_norm is not None:
                q = rms_norm(q, (dim,), layer.q_norm, eps)
            if layer.k_norm is not None:
                k = rms_norm(k, (dim,), layer.k_norm, eps)
            qk = torch.cat([q, k], dim=1)
        qk = _rotate(qk, cos, sin)
        value = qkv[:, qk_width:].view(rows, kv_heads, dim)
        attended = cache.attend(index, qk[:, :heads], qk[:, heads:], value, step.scaling)
        x = x + linear(attended, layer.o, layer.o_bias)
        gate, up = linear(rms_norm(x, hidden, layer.post_norm, eps), layer.gate_up).chunk(2, -1)
        x = x + linear(torch.nn.functional.silu(gate) * up, layer.down)
    cache.length += 1
    return step.unembedding(rms_norm(x, hidden, step.final_norm, eps))


def rotary_table(step: _DecodeStep, positions: int) -> tuple[Tensor, Tensor]:
    """(cos, sin±) [positions, head_dim] at positions 0..positions-1; sin± = (−sin₁, sin₂)."""
    ids = torch.arange(positions).unsqueeze(0)
    cos, sin = step.rotary(step.embed[:1].unsqueeze(0), ids)
    return cos[0].contiguous(), signed_sine(sin[0]).contiguous()


class DecodeCache:
    """Keys and values of every decoding row, attended in one call per layer.

    Slot ``s`` holds one row's keys/values ``[kv_heads, capacity, head_dim]`` per layer;
    position ``p`` of a row with prompt length ``n`` is visible from every later query of
    the row when ``p >= width - n`` (the prompt is right-aligned at ``width``), through an
    additive bias of 0 or -inf shared by every layer.
    """

    def __init__(self, prefill: RowKVCache, source: Tensor, step: _DecodeStep) -> None:
        width, capacity = prefill.width, prefill.capacity
        self.length = prefill.length
        # Whole contiguous buffers: gathering only the filled part is a strided copy, slower.
        self.keys = [prefill.keys[layer].index_select(0, source) for layer in sorted(prefill.keys)]
        self.values = [
            prefill.values[layer].index_select(0, source) for layer in sorted(prefill.values)
        ]
        kv_heads = self.keys[0].shape[1]
        first_valid = width - prefill.prompt_lengths[source]
        hidden = torch.arange(capacity).unsqueeze(0) < first_valid.unsqueeze(1)
        bias = torch.zeros(len(source), kv_heads, 1, capacity)
        bias.masked_fill_(hidden[:, None, None, :], -math.inf)
        self.bias = bias.view(len(source) * kv_heads, 1, capacity)
        self.cos, self.sin = rotary_table(step, capacity)

    def attend(
        self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float
    ) -> Tensor:
        """Store this position's keys/values [rows, kv_heads, dim]; attend: [rows, heads·dim]."""
        rows, heads, dim = query.shape
        kv_heads, end = key.shape[1], self.length + 1
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.length] = key
        values[:, :, self.length] = value
        grouped = query.reshape(rows * kv_heads, heads // kv_heads, dim)
        products = torch.bmm(grouped, keys[:, :, :end].reshape(rows * kv_heads, end, dim).mT)
        weights = torch.softmax(torch.add(self.bias[:, :, :end], products, alpha=scaling), -1)
        attended = torch.bmm(weights, values[:, :, :end].reshape(rows * kv_heads, end, dim))
        return attended.view(rows, heads * dim)

    def compact(self, active: list[int]) -> list[int] | None:
        """Drop finished slots when a ROW_MULTIPLE of them can go; the new slot order, or None.

        The new batch keeps ``len(active)`` rounded up to ``ROW_MULTIPLE`` slots; active
        rows past that end move into freed slots before it (their keys, values and bias
        rows copied), so the returned order lists, for each new slot, the old slot it holds.
        """
        slots = len(self.keys[0])
        kept = len(active) + _padding(len(active))
        if kept >= slots:
            return None
        movers = [slot for slot in active if slot >= kept]
        active_set = set(active)
        free = [slot for slot in range(kept) if slot not in active_set][: len(movers)]
        order = list(range(kept))
        if movers:
            source, target = torch.tensor(movers), torch.tensor(free)
            for buffer in (*self.keys, *self.values):
                buffer[target, :, : self.length] = buffer[source, :, : self.length]
            kv_heads = self.keys[0].shape[1]
            bias = self.bias.view(slots, kv_heads, 1, -1)
            bias[target] = bias[source]
            for old, new in zip(movers, free, strict=True):
                order[new] = old
        self.keys = [buffer[:kept] for buffer in self.keys]
        self.values = [buffer[:kept] for buffer in self.values]
        kv_heads = self.keys[0].shape[1]
        self.bias = self.bias[: kept * kv_heads]
        return order
