"""Attention over each row's own tokens: the sampler's KV cache and its masked attention.

``RowKVCache`` holds left-padded rows' keys and values and attends group by group over
each row's own span (its prompt length rounded up to ``SPAN_BUCKET``), so what a row
computes never depends on its batch; ``ROW_MULTIPLE`` is the row count a call is padded
to so that linear layers compute each row on its own.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo.backends.local.model import RowAttention

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


def _padding(rows: int) -> int:
    """How many filler rows bring `rows` (at least 1) to a multiple of ROW_MULTIPLE."""
    return -rows % ROW_MULTIPLE if rows else ROW_MULTIPLE
