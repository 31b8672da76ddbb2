"""The built-in tiny model: a ~1M-parameter Qwen3 with a small byte-level BPE tokenizer.

It ships warm-started (weights and tokenizer in ``tiny_model/``) so that GRPO has something
to improve on the built-in problems, offline, on two CPU cores. ``scripts/make_tiny_model.py``
regenerates the shipped files bit-for-bit. ``tiny_model/`` is an ordinary Hugging Face
model directory, so ``base_model=<path to tiny_model>`` loads the same model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from grpo.backends.names import TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME

TINY_MODEL_DIR = Path(__file__).parent / "tiny_model"
TINY_TOOLS_MODEL_DIR = Path(__file__).parent / "tiny_model_tools"
"""The tool-use warm start (``scripts/make_tiny_model.py --tools``): same tokenizer."""
MODEL_DIRS = {TINY_MODEL_NAME: TINY_MODEL_DIR, TINY_TOOLS_MODEL_NAME: TINY_TOOLS_MODEL_DIR}

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
# Special tokens take ids 0, 1, 2 (pad first); the think markers are plain added tokens
# (the last two ids) that decoding keeps, as in Qwen3.
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
ADDED_TOKENS = (THINK_START, THINK_END)
VOCAB_SIZE = 512
MAX_POSITIONS = 2048

# Qwen2's pre-tokenizer split: words with their leading non-letter, single digits,
# punctuation runs, newline runs, other whitespace. Bytes are then mapped to characters.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's chat template for turns and tools (docs/FORMULAS.md, "Chat template"): with
# `tools`, a first system turn holding the system message, then "# Tools" and one JSON
# signature a line in <tools></tools>; an assistant's `tool_calls` as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> after its content; consecutive
# `tool` messages as one user turn of <tool_response>\n...\n</tool_response> blocks. Without
# tools, tool calls or tool messages it renders exactly as before (each message as
# <|im_start|>role\ncontent<|im_end|>\n). `enable_thinking` is accepted and renders nothing:
# the built-in models have no thinking mode (Qwen3 writes an empty <think></think> after the
# generation prompt under enable_thinking=False and one before the last assistant turn; the
# shipped models were trained without them, and the multi-turn loop needs a rendering that
# grows by extension). An assistant turn's content, tool calls and <|im_end|> are marked
# {% generation %}, the tokens `return_assistant_tokens_mask` (and so `grpo sft`) trains on;
# the marks render nothing.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_text(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}"
    "{% endif %}"
    "{{ " + _jinja_text(TOOLS_PREAMBLE) + " }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ " + _jinja_text(TOOLS_POSTAMBLE) + " + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set content = message['content'] if message['content'] is string else '' %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ content }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if loop.first and content or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}"
    "{% endif %}"
    "{{ '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `vocab_size` ids trained on `corpus`: all 256 bytes, then merges.

    Every UTF-8 string round-trips exactly through encode/decode (no normalizer, no unknown
    token, no clean-up of spaces). The corpus is cut at special and added tokens first, as
    encoding cuts text. Training is deterministic for the same corpus.
    """
    markers = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS + ADDED_TOKENS))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(
        (piece for text in corpus for piece in markers.split(text) if piece), trainer
    )
    backend.add_tokens(list(ADDED_TOKENS))
    return _wrap(backend)


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer: left padding, <|im_end|> as EOS, the chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The shipped tokenizer (``tiny_model/tokenizer.json``), as `train_tokenizer` made it."""
    path = TINY_MODEL_DIR / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(
            f"built-in tokenizer missing at {path}; regenerate it with "
            "`python scripts/make_tiny_model.py`"
        )
    return _wrap(Tokenizer.from_file(str(path)))


def tiny_config(vocab_size: int) -> Qwen3Config:
    """The built-in architecture: hidden 128, 4 layers, ~1.05M parameters at 512 ids."""
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


def init_tiny_model(
    seed: int, tokenizer: PreTrainedTokenizerFast | None = None
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised tiny model (the warm start's start); shipped tokenizer by default."""
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config(len(tokenizer)))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def load_tiny_model(
    name: str = TINY_MODEL_NAME,
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """A shipped warm-started tiny model by name (fp32, eval mode) and the shipped tokenizer."""
    directory = MODEL_DIRS[name]
    weights = directory / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(
            f"built-in model weights missing at {weights}; regenerate them with "
            f"`python scripts/make_tiny_model.py{' --tools' if name != TINY_MODEL_NAME else ''}`"
        )
    tokenizer = build_tokenizer()
    # A 46-tensor file loads in milliseconds; its progress bar would only clutter every run.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = Qwen3ForCausalLM.from_pretrained(directory, local_files_only=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.float().eval(), tokenizer
