"""The trainer's shared-prefix forward: datums that begin alike share one pass over their start.

In GRPO a group's G datums share their prompt, most of their positions. ``group_by_prefix``
finds such groups from the datums' input tokens alone (no API change: a PyTRIO client or
``grpo serve`` sends plain datums); ``pack_rows`` lays each group out as one row, the shared
prefix once and then every member's remaining tokens, with position ids that continue the
prefix for each member and an attention mask under which a member's token sees the prefix
and its own earlier tokens only (the "shared-prefix forward" of Prefix Grouper, arXiv
2506.05433). Autograd then accumulates the gradient of the shared positions once, summed
over the members that attend to them. ``target_logprobs`` (what the trainer calls) runs
the rows through the sampler's merged step (`_DecodeStep`, LoRA merged under autograd) with
``PackedAttention``, and unembeds only the positions a target reads (never the prompt
positions a GRPO datum masks with the ignore index), each shared position once; a batch
with nothing shared runs `ModelHost.target_logprobs`, one padded row per datum, as before.

Same math as the unshared forward: every member token's attention covers exactly the keys
it covered there, at the same positions (docs/FORMULAS.md, "Shared-prefix forward"); the
rounding differs (other matmul shapes, merged LoRA, a masked instead of a causal attention
kernel), by ~1e-7 on a log-prob (`tests/backends/test_shared_prefix.py` checks log-probs
and gradients to 1e-5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from grpo.backends.datums import IGNORE_INDEX
from grpo.backends.local.model import ModelHost, RowAttention
from grpo.backends.local.sampler.merged import _DecodeStep

# Decoders whose causal-LM head is exactly `lm_head(final-normed hidden state)` (no logit
# scaling or soft-capping) and whose attention goes through the backend's attention interface.
SHARED_PREFIX_MODEL_TYPES = ("qwen3", "qwen2", "llama")
# Up to this many parameters the trainer runs the merged step (LoRA merged into fused
# weights on every call: ~5 ms of a ~45 ms call on the built-in model); a larger model would
# copy all its matmul weights per call, so it runs PEFT's own forward on the packed rows.
MERGED_STEP_MAX_PARAMETERS = 20_000_000
# Largest rows x heads x L x L score tensor the matmul attention builds (256 MiB of float32).
MATMUL_ATTENTION_SCORES = 2**26


@attrs.frozen
class PrefixGroup:
    """Datums (indices into the request) whose inputs share their first `prefix_length` tokens."""

    members: tuple[int, ...]
    prefix_length: int


@attrs.frozen
class PackedRows:
    """Groups laid out as right-padded rows: ids, positions, mask, and where each datum lies."""

    input_ids_RL: Tensor
    position_ids_RL: Tensor
    attends_RLL: Tensor  # bool: query column attends key column
    column_N: np.ndarray  # per position of every datum (end to end): its flat row*L + column


def _common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    size = min(len(left), len(right))
    differ = np.flatnonzero(np.asarray(left[:size]) != np.asarray(right[:size]))
    return int(differ[0]) if len(differ) else size


def row_cost(length: int, attention_weight: float) -> float:
    """The cost of one packed row of `length` positions: L + ρ·L² (linear layers + attention)."""
    return length + attention_weight * length * length


def group_by_prefix(
    inputs: Sequence[Sequence[int]], attention_weight: float = 0.0
) -> list[PrefixGroup]:
    """Datums grouped by shared leading tokens, each group one packed row.

    Datums are taken in lexicographic order of their tokens, so those sharing a prefix are
    neighbours; a datum joins its predecessor's group when one row costs less (`row_cost`:
    positions, plus ``attention_weight`` x squared length for a dense attention mask) than
    the group's row and its own, i.e. when sharing saves more positions than the longer
    row adds attention. A group's prefix is the members' common prefix (for sorted
    sequences the minimum over neighbours); a lone datum's prefix is the whole datum.
    """
    order = sorted(range(len(inputs)), key=lambda index: tuple(inputs[index]))
    groups: list[PrefixGroup] = []
    members: list[int] = []
    prefix = 0
    tails = 0  # the members' positions after the prefix
    for index in order:
        length = len(inputs[index])
        if members:
            shared = min(prefix, _common_prefix(inputs[members[-1]], inputs[index]))
            joined = shared + tails + (prefix - shared) * len(members) + length - shared
            apart = row_cost(prefix + tails, attention_weight) + row_cost(length, attention_weight)
            if shared > 0 and row_cost(joined, attention_weight) < apart:
                tails = joined - shared
                prefix = shared
                members.append(index)
                continue
            groups.append(PrefixGroup(tuple(members), prefix))
        members, prefix, tails = [index], length, 0
    if members:
        groups.append(PrefixGroup(tuple(members), prefix))
    return groups


def pack_rows(inputs: Sequence[Sequence[int]], groups: Sequence[PrefixGroup]) -> PackedRows:
    """One row per group: the prefix, then each member's tokens after it, right padded.

    A member's token at position t >= p (p the prefix length) keeps position id t and attends
    to the prefix columns and to its own columns up to itself; prefix columns attend
    causally among themselves; a padding column attends to itself only (its output is
    never read).
    """
    lengths = [
        sum(len(inputs[member]) for member in group.members)
        - (len(group.members) - 1) * group.prefix_length
        for group in groups
    ]
    width = max(lengths)
    input_ids = np.zeros((len(groups), width), dtype=np.int64)
    positions = np.zeros((len(groups), width), dtype=np.int64)
    segment = np.full((len(groups), width), -1, dtype=np.int64)  # 0 prefix, j member j, -1 pad
    columns_of: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(inputs)
    for row, group in enumerate(groups):
        prefix = group.prefix_length
        input_ids[row, :prefix] = inputs[group.members[0]][:prefix]
        positions[row, :prefix] = np.arange(prefix)
        segment[row, :prefix] = 0
        cursor = prefix
        for number, member in enumerate(group.members, start=1):
            tokens = inputs[member]
            tail = len(tokens) - prefix
            input_ids[row, cursor : cursor + tail] = tokens[prefix:]
            positions[row, cursor : cursor + tail] = np.arange(prefix, len(tokens))
            segment[row, cursor : cursor + tail] = number
            own = np.concatenate([np.arange(prefix), np.arange(cursor, cursor + tail)])
            columns_of[member] = row * width + own
            cursor += tail
    segment_t = torch.from_numpy(segment)
    query, key = segment_t[:, :, None], segment_t[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    attends = causal & ((key == 0) | (key == query)) & (query >= 0)
    attends |= torch.eye(width, dtype=torch.bool)  # padding sees itself; real columns already do
    return PackedRows(
        input_ids_RL=torch.from_numpy(input_ids),
        position_ids_RL=torch.from_numpy(positions),
        attends_RLL=attends.unsqueeze(1),
        column_N=np.concatenate(columns_of) if columns_of else np.zeros(0, dtype=np.int64),
    )


def attention_weight(config: object) -> float:
    """ρ of `row_cost` for a model: attention FLOPs per (query, key) pair over linear-layer
    FLOPs per position, 4·layers·heads·head_dim / (2 x matmul weights per position)."""
    hidden = int(config.hidden_size)  # type: ignore[attr-defined]
    heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    weights = layers * (
        hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * int(config.intermediate_size)  # type: ignore[attr-defined]
    ) + hidden * int(config.vocab_size)  # type: ignore[attr-defined]
    return 4 * layers * heads * head_dim / (2 * weights)


def read_positions(
    lengths: Sequence[int], targets: Sequence[np.ndarray], *, auto_shift: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entry, source position, target) of every log-prob a target reads, in the datums'
    end-to-end order: entry t of a datum reads position t (t - 1 under ``auto_shift``, entry
    0 then reads nothing); IGNORE_INDEX targets read nothing (their log-prob is 0)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat_targets = (
        np.concatenate(
            [np.asarray(t, dtype=np.int64)[:n] for t, n in zip(targets, lengths, strict=True)]
        )
        if lengths
        else np.zeros(0, dtype=np.int64)
    )
    entries = np.flatnonzero(flat_targets != IGNORE_INDEX)
    source = entries
    if auto_shift:
        entries = entries[~np.isin(entries, offsets[:-1])]  # entry 0 of each datum predicts nothing
        source = entries - 1
    return entries, source, flat_targets[entries]


class PackedAttention(RowAttention):
    """Attention over packed rows: a query column sees the key columns `attends_R1LL` marks.

    Two batched matmuls and a softmax under an additive mask (the sampler's `_attention`)
    while the scores fit in `MATMUL_ATTENTION_SCORES`: at the lengths of GRPO groups
    (~100-300 columns) PyTorch's CPU flash kernel with a mask, and its backward, cost ~5x
    the arithmetic. Longer rows take that kernel (`scaled_dot_product_attention`), which
    never holds a rows x heads x L x L score tensor.
    """

    def __init__(self, attends_R1LL: Tensor) -> None:
        self.attends_R1LL = attends_R1LL
        self._bias_R1LL: Tensor | None = None

    def attend(
        self, layer_index: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
    ) -> Tensor:
        """softmax(q·kᵀ·scale + mask)·v over grouped-query heads: [rows, L, heads, head_dim]."""
        del layer_index  # every layer attends under the same mask
        rows, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        scale = dim**-0.5 if scaling is None else scaling
        if rows * heads * length * length > MATMUL_ATTENTION_SCORES:
            attended = torch.nn.functional.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=self.attends_R1LL,
                scale=scale,
                enable_gqa=kv_heads != heads,
            )
            return attended.transpose(1, 2)
        if self._bias_R1LL is None:
            bias = torch.zeros(self.attends_R1LL.shape)
            self._bias_R1LL = bias.masked_fill_(~self.attends_R1LL, -math.inf)
        per_kv_head = heads // kv_heads
        grouped = (query * scale).reshape(rows, kv_heads, per_kv_head * length, dim)
        scores = (grouped @ key.transpose(-1, -2)).view(rows, kv_heads, per_kv_head, length, -1)
        scores = scores + self._bias_R1LL.unsqueeze(1)
        weights = torch.softmax(scores, dim=-1).view(rows, kv_heads, per_kv_head * length, -1)
        return (weights @ value).view(rows, heads, length, dim).transpose(1, 2)

    def advance(self, query_length: int) -> None:
        """Nothing to keep: the trainer feeds every position in one call."""


def target_logprobs(
    host: ModelHost,
    inputs: Sequence[Sequence[int]],
    targets: Sequence[np.ndarray],
    *,
    auto_shift: bool,
) -> list[Tensor]:
    """`ModelHost.target_logprobs` (log p(target_t | input_<=t) per datum, autograd-connected,
    0 at IGNORE_INDEX targets; ``auto_shift``: entry t reads input_<t, entry 0 is 0), with
    datums that begin alike sharing one pass over their common start.

    For the decoders `SHARED_PREFIX_MODEL_TYPES` names (and ``host.shared_prefix_forward``),
    when some datums share a prefix: the rows of `pack_rows` go through the merged step
    (`_DecodeStep`, the sampler's forward: the active LoRA merged into fused weights, here
    autograd-connected to the adapter's parameters; PEFT's forward for models above
    `MERGED_STEP_MAX_PARAMETERS`), and only the positions some target reads are unembedded,
    each once; its log-softmax is gathered at every target that reads it. Otherwise one
    padded row per datum through the Hugging Face forward (`ModelHost.target_logprobs`).
    """
    config = host.model.config
    if not (
        host.shared_prefix_forward and inputs and config.model_type in SHARED_PREFIX_MODEL_TYPES
    ):
        return host.target_logprobs(inputs, targets, auto_shift=auto_shift)
    groups = group_by_prefix(inputs, attention_weight(config))
    if all(len(group.members) == 1 for group in groups):  # nothing shared: one row a datum
        return host.target_logprobs(inputs, targets, auto_shift=auto_shift)
    lengths = [len(tokens) for tokens in inputs]
    packed = pack_rows(inputs, groups)
    attention = PackedAttention(packed.attends_RLL)
    step = None
    if host.model.num_parameters() <= MERGED_STEP_MAX_PARAMETERS:
        step = _DecodeStep.build(host.model)  # under autograd: the merge is differentiable
    if step is not None:
        hidden = step.hidden(packed.input_ids_RL, packed.position_ids_RL, attention)
        unembed: Callable[[Tensor], Tensor] = step.unembedding
    else:  # a large model, or one the merged step does not compute: PEFT's own forward
        hidden = host.model.get_decoder()(
            input_ids=packed.input_ids_RL,
            position_ids=packed.position_ids_RL,
            attention_mask={layer_type: attention for layer_type in host.layer_types},
            use_cache=False,
        ).last_hidden_state
        unembed = host.model.get_output_embeddings()
    entries, source, target = read_positions(lengths, targets, auto_shift=auto_shift)
    read, reader = np.unique(packed.column_N[source], return_inverse=True)
    logits = unembed(hidden.reshape(-1, hidden.shape[-1])[torch.from_numpy(read)])
    reader_t = torch.from_numpy(reader.reshape(-1))
    picked = logits[reader_t, torch.from_numpy(target)] - torch.logsumexp(logits, dim=-1)[reader_t]
    flat = torch.zeros(sum(lengths), dtype=picked.dtype).index_put(
        (torch.from_numpy(entries),), picked
    )
    return list(flat.split(lengths))
