"""The built-in tiny model: a ~1M-parameter Qwen3 with a character-level tokenizer.

It ships warm-started (weights in ``tiny_model/``) so that GRPO has something to improve
on the built-in arithmetic problems, offline, on two CPU cores. ``scripts/make_tiny_model.py``
regenerates the shipped files bit-for-bit.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from grpo.backends.names import TINY_MODEL_NAME

TINY_MODEL_DIR = Path(__file__).parent / "tiny_model"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
MAX_POSITIONS = 256
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

# Printable ASCII (space included) minus tab-like whitespace and `|~, plus newline: 93 characters.
_CHARACTERS = "\n" + "".join(
    c for c in string.printable if c not in "\t\r\x0b\x0c\n" and c not in "`|~"
)

# Qwen-style chat template; `enable_thinking` is accepted and ignored (no thinking mode).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, specials first (pad id 0)."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for character in _CHARACTERS:
        vocab.setdefault(character, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int) -> Qwen3Config:
    """The architecture of the built-in model (see LOCAL_MODEL_NOTES: ~1.0M parameters)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )


def init_tiny_model(seed: int) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised tiny model (the warm-start script's starting point)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config(len(tokenizer)))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def load_tiny_model() -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """The shipped warm-started tiny model (fp32, eval mode) and its tokenizer."""
    weights = TINY_MODEL_DIR / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(
            f"built-in model weights missing at {weights}; regenerate them with "
            "`python scripts/make_tiny_model.py`"
        )
    tokenizer = build_tokenizer()
    # A 46-tensor file loads in milliseconds; its progress bar would only clutter every run.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = Qwen3ForCausalLM.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.float().eval(), tokenizer
