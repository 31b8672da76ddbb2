"""The sampler's batch: one prefill and one KV-cached decode loop for many requests.

``sample_batch`` is what the worker runs on every pending request for one set of
weights: the distinct prompts are prefilled once, every sequence decodes together, and
each finished row becomes a ``SampleSequence`` (stop rules in ``_stop_reason``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import attrs
import numpy as np
import torch
from pytrio.types import SampleResponse, SampleSequence
from torch import Tensor

from grpo.backends.local.model import AdapterWeights, ModelHost
from grpo.backends.local.sample_request import PendingSample, SampleSpec
from grpo.backends.local.sampler.attention import RowKVCache, _bucket, _padding, _runs
from grpo.backends.local.sampler.choice import _uniforms, choose_tokens
from grpo.backends.local.sampler.decode import DecodeCache, decode_logits
from grpo.backends.local.sampler.merged import _DecodeStep, _merged_step


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
        # Inference mode for the forward passes only (the adapter is loaded and the merged
        # step built before): its tensors skip autograd's version counters, ~1.05-1.08x the
        # whole batch here (benchmarks/README.md, issue 39); none of them leaves this call.
        with loaded, reduced, torch.inference_mode():
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


class _RowCacheSlots:
    """The decode state of the Hugging Face path (or of the merged step with
    ``host.one_call_decode`` off): a `RowKVCache`, attended span by span."""

    def __init__(self, model: _Model, cache: RowKVCache) -> None:
        self.model = model
        self.cache = cache

    def logits(self, tokens_R: Tensor, positions_R: Tensor) -> Tensor:
        """Next-token logits [rows, vocab] after one new token per row."""
        return self.model.decode(tokens_R, positions_R, self.cache)

    def compact(self, active: list[int]) -> list[int] | None:
        """Drop finished slots once at most half the slots are active (rows stay sorted)."""
        slots = len(self.cache.prompt_lengths)
        if len(active) + _padding(len(active)) > slots // 2:
            return None
        active_set = set(active)
        spare = [slot for slot in range(slots) if slot not in active_set]
        keep = sorted(active + spare[: _padding(len(active))])
        self.cache = self.cache.select(torch.tensor(keep))
        return keep


class _MergedSlots:
    """The decode state of the merged step: one attention call per layer (``decode.py``)."""

    def __init__(self, step: _DecodeStep, cache: DecodeCache, vocab_size: int) -> None:
        self.step = step
        self.cache = cache
        self.vocab_size = vocab_size

    def logits(self, tokens_R: Tensor, positions_R: Tensor) -> Tensor:
        """Next-token logits [rows, vocab] after one new token per row."""
        logits = decode_logits(self.step, tokens_R, positions_R, self.cache)
        return logits[:, : self.vocab_size].float()

    def compact(self, active: list[int]) -> list[int] | None:
        """Drop finished slots whenever a ROW_MULTIPLE of them can go."""
        return self.cache.compact(active)


def _decode(
    model: _Model,
    host: ModelHost,
    specs: Sequence[SampleSpec],
    prefill: _Prefill,
    stopping: threading.Event,
) -> list[_Row]:
    """The KV-cached decode loop over every sequence of every generating request.

    Batch slot ``s`` decodes row ``slot_list[s]`` while ``s`` is in ``live``; the other
    slots (filler: finished rows, or copies that pad the batch to a ROW_MULTIPLE) compute
    outputs nobody reads.
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
    slot_list = list(range(len(rows))) + [len(rows) - 1] * _padding(len(rows))
    prompt_row = {prompt: row for row, prompt in enumerate(prefill.prompts)}
    source = torch.tensor([prompt_row[spec_of[row].prompt] for row in slot_list])
    slots: _RowCacheSlots | _MergedSlots
    if model.fast is not None and host.one_call_decode:
        cache = DecodeCache(prefill.cache, source, model.fast)
        slots = _MergedSlots(model.fast, cache, model.vocab_size)
    else:
        slots = _RowCacheSlots(model, prefill.cache.select(source))
    logits = prefill.last_logits.index_select(0, source)

    temperature = torch.tensor([spec.temperature for spec in spec_of], dtype=torch.float64)
    top_k = torch.tensor([spec.top_k if spec.top_k > 0 else host.vocab_size for spec in spec_of])
    top_p = torch.tensor([spec.top_p for spec in spec_of], dtype=torch.float64)
    prompt_lengths = torch.tensor([row.prompt_length for row in rows])
    horizon = max(spec.max_tokens for spec in spec_of)
    uniforms = torch.from_numpy(
        np.stack(
            [
                _uniforms(spec.seed, row.sample_index, horizon)
                for spec, row in zip(spec_of, rows, strict=True)
            ]
        )
    )
    # Per slot, for the current slot layout: each row's sampling parameters and prompt length.
    slot_rows = torch.tensor(slot_list)
    layout = [tensor[slot_rows] for tensor in (temperature, top_k, top_p, uniforms, prompt_lengths)]
    live = list(range(len(rows)))  # the slots after them are filler
    for step in range(horizon):
        if stopping.is_set():
            raise RuntimeError("the local service stopped while this request was sampling")
        temperature_S, top_k_S, top_p_S, uniforms_S, _ = layout
        tokens, logprobs = choose_tokens(
            logits, temperature_S, top_k_S, top_p_S, uniforms_S[:, step]
        )
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        active = []
        for slot in live:
            index = slot_list[slot]
            row = rows[index]
            row.tokens.append(token_list[slot])
            row.logprobs.append(logprob_list[slot])
            row.stop_reason = _stop_reason(row, spec_of[index], host)
            if row.stop_reason is None:
                active.append(slot)
        if not active:
            break
        order = slots.compact(active)
        if order is None:
            live = active
        else:  # finished rows dropped (kept slots that are not active: filler)
            active_set = set(active)
            live = [new for new, old in enumerate(order) if old in active_set]
            slot_list = [slot_list[old] for old in order]
            moved = torch.tensor(order)
            tokens = tokens[moved]
            layout = [tensor[moved] for tensor in layout]
        # A filler slot feeds whatever token it drew; its output is never read.
        prompt_lengths_S = layout[4]
        logits = slots.logits(tokens, prompt_lengths_S + step)
    return rows


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
