"""The in-process model behind the local backend: base model, LoRA adapters, log-probs.

A `ModelHost` holds one base model (the built-in tiny model, or a local Hugging Face
directory) with every LoRA adapter attached to it: one per training client, plus one
"sampler slot" per adapter shape into which a sampling client's frozen weights are copied
before it samples. Base weights are frozen and never written.

LoRA choices (documented in the README of the local backend):

- ``lora_alpha = 32`` for every rank, so the update is scaled by ``32 / rank`` (the
  Tinker convention: the best learning rate barely moves with the rank).
- ``train_attn`` targets ``q_proj, k_proj, v_proj, o_proj``; ``train_mlp`` targets
  ``gate_proj, up_proj, down_proj``; ``train_unembed`` targets the output projection
  (``lm_head``). With tied embeddings (the tiny model, small Qwens) the adapter changes
  the unembedding only: the shared input embedding stays frozen.
- No LoRA dropout; A is Kaiming-initialised from the client's seed, B is zero, so a fresh
  adapter leaves the model's outputs unchanged.

Every method here runs on the service's single worker thread.
"""

from __future__ import annotations

import copy
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from pytrio.errors.base import ValidationError
from torch import Tensor, nn
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grpo.backends.datums import IGNORE_INDEX
from grpo.backends.local import tiny

LORA_ALPHA = 32
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MIN_LORA_RANK, MAX_LORA_RANK = 4, 64  # PyTRIO's accepted range

# Sampling passes a `RowAttention` object where the attention mask goes; anything else
# (training) falls through to PyTorch's scaled-dot-product attention unchanged.
ROW_ATTENTION = "grpo_row_attention"


class RowAttention(ABC):
    """The interface the sampler's per-row attention state implements (``sampler/attention.py``)."""

    @abstractmethod
    def attend(
        self, layer_index: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
    ) -> Tensor:
        """Attention output [rows, q_len, heads, head_dim] for one layer (stores key/value)."""


def _row_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: object,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    if isinstance(attention_mask, RowAttention):
        return attention_mask.attend(module.layer_idx, query, key, value, scaling), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


AttentionInterface.register(ROW_ATTENTION, _row_attention_forward)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


@attrs.frozen
class LoraSpec:
    """A LoRA run's configuration, as PyTRIO's `create_lora_training_client` takes it."""

    rank: int
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool

    def __attrs_post_init__(self) -> None:
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not (MIN_LORA_RANK <= self.rank <= MAX_LORA_RANK)
        ):
            raise ValidationError(
                f"rank must be in [{MIN_LORA_RANK}, {MAX_LORA_RANK}]. Got {self.rank}",
                code="validation.invalid_lora_rank",
            )
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValidationError(
                "train_mlp, train_attn and train_unembed are all False: nothing to train; "
                "set at least one of them to True",
                code="validation.invalid_lora_config",
            )

    @property
    def shape(self) -> tuple[int, bool, bool, bool]:
        """What fixes the adapter's tensors (everything but the seed)."""
        return (self.rank, self.train_mlp, self.train_attn, self.train_unembed)

    def to_wire(self) -> dict[str, object]:
        """The spec under PyTRIO's wire names (``lora_rank``, ``seed``, ``train_*``), the
        names a checkpoint's ``grpo_local.json`` stores it under too."""
        return {name: getattr(self, attribute) for attribute, name, _convert in _WIRE_FIELDS}

    @classmethod
    def from_wire(cls, record: Mapping[str, object]) -> LoraSpec:
        """The validated spec of a record `to_wire` wrote (checkpoint metadata, a request)."""
        return cls(
            **{attribute: convert(record[name]) for attribute, name, convert in _WIRE_FIELDS}
        )


# The one list of LoRA fields outside the class: (LoraSpec attribute, its name on PyTRIO's wire
# and in checkpoint metadata, the conversion a record's value gets), in the class's order.
_WIRE_FIELDS: tuple[tuple[str, str, Callable[[Any], object]], ...] = (
    ("rank", "lora_rank", int),
    ("seed", "seed", int),
    ("train_mlp", "train_mlp", bool),
    ("train_attn", "train_attn", bool),
    ("train_unembed", "train_unembed", bool),
)


def lora_wire_fields(record: Mapping[str, object]) -> dict[str, object]:
    """The LoRA fields of a PyTRIO request under their wire names, converted as `from_wire`
    converts them but not validated; a missing or None ``seed`` stays None (drawn later)."""
    fields: dict[str, object] = {}
    for _attribute, name, convert in _WIRE_FIELDS:
        if name == "seed" and record.get(name) is None:
            fields[name] = None
        else:
            fields[name] = convert(record[name])
    return fields


@attrs.frozen
class AdapterWeights:
    """Frozen LoRA tensors (PEFT state-dict names) and the spec that shaped them."""

    spec: LoraSpec
    tensors: dict[str, Tensor] = attrs.field(eq=False, repr=False)


class ModelHost:
    """One base model in memory with its tokenizer, limits and attached LoRA adapters."""

    def __init__(self, model_id: str, model: PreTrainedModel, tokenizer: object) -> None:
        config = model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValidationError(
                f"base model {model_id!r} uses {sorted(layer_types)} layers; the local backend "
                "supports full-attention decoders only (e.g. Qwen2.5/Qwen3 without sliding window)",
                code="validation.unsupported_model",
            )
        model.set_attn_implementation(ROW_ATTENTION)
        self.model_id = model_id
        self.model = model.float().eval().requires_grad_(False)
        self.tokenizer = tokenizer
        # The worker decodes with its own copy: a fast tokenizer shared with user threads can
        # fail with "Already borrowed" when two threads use it at once.
        self.decoder = copy.deepcopy(tokenizer)
        self.layer_types = sorted(layer_types)
        self.vocab_size = len(tokenizer)  # PyTRIO validates token ids against the tokenizer
        self.max_positions = int(config.max_position_embeddings)
        self.end_token_ids = _end_token_ids(model, tokenizer)
        output_embeddings = model.get_output_embeddings()
        self.unembed_module = next(
            name for name, module in model.named_modules() if module is output_embeddings
        )
        self.peft_model: PeftModel | None = None
        self._adapter_count = 0
        self._slots: dict[tuple[int, bool, bool, bool], str] = {}
        self._slot_contents: dict[str, AdapterWeights] = {}
        # The sampler's merged decode step for the weights it last sampled with (kept by
        # grpo.backends.local.sampler.merged): (weights, peft model then, step).
        self.merged_sampler: tuple[AdapterWeights | None, PeftModel | None, object] | None = None
        # Whether the trainer may share datums' common prefixes (grpo.backends.local.
        # shared_prefix, for the decoders it knows); benchmarks turn it off to time without.
        self.shared_prefix_forward = True
        # Whether the sampler's merged step decodes all rows in one attention call a layer
        # (grpo.backends.local.sampler.decode) or span by span through the prefill's
        # RowKVCache, as before issue 39; benchmarks and tests compare the two.
        self.one_call_decode = True

    # --- adapters -------------------------------------------------------------------

    def lora_config(self, spec: LoraSpec) -> LoraConfig:
        """The PEFT config of an adapter with this spec (what `adapter_config.json` holds)."""
        targets = [
            *(ATTENTION_MODULES if spec.train_attn else ()),
            *(MLP_MODULES if spec.train_mlp else ()),
            *((self.unembed_module,) if spec.train_unembed else ()),
        ]
        return LoraConfig(
            r=spec.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=targets,
        )

    def add_adapter(self, spec: LoraSpec, *, prefix: str = "train") -> str:
        """Attach a fresh adapter initialised from `spec.seed`; returns its name."""
        name = f"{prefix}{self._adapter_count}"
        self._adapter_count += 1
        config = self.lora_config(spec)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(spec.seed)
            # PEFT warns that a LoRA on a tied lm_head is not tied to the input embedding:
            # that is the documented choice here (the adapter changes the unembedding only).
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            try:
                if self.peft_model is None:
                    self.peft_model = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self.peft_model.add_adapter(name, config)
            except ValueError as error:
                raise ValidationError(
                    f"cannot attach a LoRA to {self.model_id!r} ({error}); the local backend "
                    f"targets modules named {ATTENTION_MODULES + MLP_MODULES} and the output "
                    "projection, as in Qwen and Llama models",
                    code="validation.unsupported_model",
                ) from None
        self.model.eval()
        return name

    def delete_adapter(self, name: str) -> None:
        """Detach an adapter (its training client is gone)."""
        if self.peft_model is None or name not in self.peft_model.peft_config:
            return
        others = [other for other in self.peft_model.peft_config if other != name]
        if not others:  # PEFT keeps at least one adapter; an idle one costs only its tensors
            return
        if self.peft_model.active_adapter == name:
            # Every call activates its own adapter; this only spares PEFT's fallback warning.
            self.peft_model.set_adapter(others[0], inference_mode=True)
        self.peft_model.delete_adapter(name)

    def adapter_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """An adapter's parameters by PEFT state-dict name (the adapter name removed), sorted."""
        assert self.peft_model is not None
        marker = f".{name}."
        found = {
            parameter_name.replace(marker, "."): parameter
            for parameter_name, parameter in self.peft_model.named_parameters()
            if marker in parameter_name
        }
        return dict(sorted(found.items()))

    def snapshot(self, name: str, spec: LoraSpec) -> AdapterWeights:
        """A frozen copy of an adapter's current tensors."""
        tensors = {key: p.detach().clone() for key, p in self.adapter_parameters(name).items()}
        return AdapterWeights(spec=spec, tensors=tensors)

    def load_adapter(self, name: str, weights: AdapterWeights) -> None:
        """Copy frozen tensors into an adapter of the same shape."""
        parameters = self.adapter_parameters(name)
        if set(parameters) != set(weights.tensors):
            missing = sorted(set(parameters) - set(weights.tensors))
            unexpected = sorted(set(weights.tensors) - set(parameters))
            raise ValidationError(
                f"LoRA weights do not fit this adapter: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}",
                code="validation.checkpoint_config_mismatch",
            )
        with torch.no_grad():
            for key, parameter in parameters.items():
                source = weights.tensors[key]
                if source.shape != parameter.shape:
                    raise ValidationError(
                        f"LoRA tensor {key} has shape {tuple(source.shape)} but the adapter "
                        f"expects {tuple(parameter.shape)}",
                        code="validation.checkpoint_config_mismatch",
                    )
                parameter.copy_(source)

    def activate_training(self, name: str) -> None:
        """Make `name` the active adapter, trainable (every other adapter frozen)."""
        assert self.peft_model is not None
        self.peft_model.set_adapter(name)

    @contextmanager
    def sampling_weights(self, weights: AdapterWeights | None) -> Iterator[None]:
        """Run the block with the base model (None) or with frozen adapter weights active."""
        if weights is None:
            if self.peft_model is None:
                yield
                return
            with self.peft_model.disable_adapter():
                yield
            return
        slot = self._slots.get(weights.spec.shape)
        if slot is None:
            slot = self.add_adapter(weights.spec, prefix="sampler")
            self._slots[weights.spec.shape] = slot
        if self._slot_contents.get(slot) is not weights:
            self.load_adapter(slot, weights)
            self._slot_contents[slot] = weights
        assert self.peft_model is not None
        self.peft_model.set_adapter(slot, inference_mode=True)
        yield

    # --- forward passes -------------------------------------------------------------

    def target_logprobs(
        self, inputs: Sequence[Sequence[int]], targets: Sequence[np.ndarray], *, auto_shift: bool
    ) -> list[Tensor]:
        """log p(target_t | input_<=t) per datum (autograd-connected), 0 at IGNORE_INDEX targets.

        With ``auto_shift`` the targets are aligned with the inputs (HF labels): entry t is
        log p(target_t | input_<t) and entry 0 is 0.
        """
        lengths = [len(tokens) for tokens in inputs]
        width = max(lengths)
        input_ids = torch.zeros(len(inputs), width, dtype=torch.long)
        target_ids = torch.full((len(inputs), width), IGNORE_INDEX, dtype=torch.long)
        for row, (tokens, target) in enumerate(zip(inputs, targets, strict=True)):
            input_ids[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            target_ids[row, : len(tokens)] = torch.from_numpy(np.asarray(target, dtype=np.int64))
        # Right padding needs no attention mask: position ids 0..L-1 are right for every row,
        # causal attention never lets a real token see the padding after it, and the padded
        # positions' outputs are dropped below. Without a mask attention takes its fast path.
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        if auto_shift:
            logits, predicted = logits[:, :-1], target_ids[:, 1:]
        else:
            predicted = target_ids
        ignored = predicted == IGNORE_INDEX
        gathered = logits.gather(-1, predicted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logprobs = torch.where(ignored, 0.0, gathered - torch.logsumexp(logits, dim=-1))
        if auto_shift:
            logprobs = torch.nn.functional.pad(logprobs, (1, 0))
        return [logprobs[row, :length] for row, length in enumerate(lengths)]


def _end_token_ids(model: PreTrainedModel, tokenizer: object) -> frozenset[int]:
    """Tokens that end a turn: the tokenizer's EOS, the generation config's EOS ids, <|im_end|>."""
    candidates: list[object] = [getattr(tokenizer, "eos_token_id", None)]
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates.extend(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    candidates.append(tokenizer.get_vocab().get(tiny.IM_END))  # type: ignore[attr-defined]
    return frozenset(int(token) for token in candidates if isinstance(token, int))


def load_host(base_model: str) -> ModelHost:
    """Load the built-in tiny model by name, or a local Hugging Face model directory, offline."""
    if base_model in tiny.MODEL_DIRS:
        model, tokenizer = tiny.load_tiny_model(base_model)
        return ModelHost(base_model, model, tokenizer)
    directory = Path(base_model).expanduser()
    if directory.is_dir() and (directory / "config.json").is_file():
        resolved = str(directory.resolve())
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolved, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                resolved, local_files_only=True, dtype=torch.float32
            )
        except Exception as error:  # noqa: BLE001 - OSError, ValueError, tokenizers', safetensors'
            # The directory was named by the caller (a request, a --model): its damage is a
            # validation error naming it, not a crash of the backend (a 500 on `grpo serve`).
            raise ValidationError(
                f"model directory {resolved!r} cannot be loaded "
                f"({type(error).__name__}: {str(error)[:300]}); it needs a JSON config.json, "
                "the tokenizer files and the weights (model.safetensors or pytorch_model.bin), "
                "as save_pretrained writes them",
                code="validation.unsupported_model",
            ) from error
        return ModelHost(resolved, model, tokenizer)
    raise ValidationError(
        f"unknown base model {base_model!r}: the local backend supports "
        f"{list(tiny.MODEL_DIRS)}, or a local Hugging Face model directory (one holding "
        "config.json and the tokenizer files, e.g. a downloaded Qwen/Qwen2.5-0.5B-Instruct)",
        code="validation.unsupported_model",
    )
