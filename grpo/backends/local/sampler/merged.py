"""The merged decode step: the sampler's forward as plain tensor ops over LoRA-merged weights.

For the architectures ``_DecodeStep`` knows (Qwen3, Qwen2, Llama), prefill (``hidden``)
and decode (``decode.decode_logits``, the same math) run fused matmuls over the weights
with the active LoRA merged in; ``_merged_step`` builds it once per sampler weights and
keeps it on the host until other weights are sampled (None for other architectures,
which run the Hugging Face forward). The trainer's shared-prefix
forward (``grpo.backends.local.shared_prefix``) runs the same step over packed rows, built
under autograd so that the merge is differentiated into the adapter's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import attrs
import torch
from torch import Tensor

from grpo.backends.local.model import AdapterWeights, ModelHost

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


class StepAttention(Protocol):
    """What `_DecodeStep.hidden` attends through: the sampler's `RowKVCache`, or the trainer's
    packed-row attention (``grpo.backends.local.shared_prefix``)."""

    def attend(
        self, layer_index: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
    ) -> Tensor:
        """Attention output [rows, q_len, heads, head_dim] of one layer's [rows, heads, q_len,
        head_dim] queries and keys/values."""

    def advance(self, query_length: int) -> None:
        """The model call has fed `query_length` positions."""


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
    """The sampler's forward (prefill and a span-by-span decode; ``decode.decode_logits``
    decodes all rows at once with its weights) as plain tensor ops over merged weights.

    Per layer: 4 matmuls (q|k|v, o, gate|up, down) instead of 7 (plus two per LoRA
    adapter), RMSNorm as one fused op, q and k heads normed and rotated in one pass;
    attention goes through a `StepAttention` (the sampler's `RowKVCache`), so a row's
    result never depends on the batch. Same math as the Hugging Face forward, different
    rounding (merged LoRA, fused norm): log-probs agree to ~1e-6.
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

    def __call__(self, tokens_R: Tensor, positions_R: Tensor, cache: StepAttention) -> Tensor:
        """Logits [rows, embedding rows] after feeding one token per row at its position
        (the span-by-span decode; ``decode.decode_logits`` is the one-call one)."""
        hidden_R = self.hidden(tokens_R.unsqueeze(-1), positions_R.unsqueeze(-1), cache)[:, 0]
        return self.unembedding(hidden_R)

    def hidden(self, tokens_RT: Tensor, positions_RT: Tensor, cache: StepAttention) -> Tensor:
        """Final-normed hidden states [rows, T, hidden] after feeding T tokens per row."""
        rows, length, dim = tokens_RT.shape[0], tokens_RT.shape[1], self.head_dim
        x = torch.nn.functional.embedding(tokens_RT, self.embed)
        cos, sin = self.rotary(x, positions_RT)  # [rows, T, head_dim]
        cos, sin = cos.unsqueeze(2), signed_sine(sin).unsqueeze(2)  # broadcast over heads
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


def signed_sine(sin: Tensor) -> Tensor:
    """sin± = (−sin₁, sin₂) over the last axis's halves: rotate_half(x)·sin = roll(x)·sin±."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding over the last axis (halves rotated, as Hugging Face's): x·cos +
    rotate_half(x)·sin, written x·cos + roll(x, d/2)·sin± (`signed_sine`): the same
    products, four operations instead of six."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
