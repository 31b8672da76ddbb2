"""Names the CLI's defaults need, importable without torch: the built-in models."""

TINY_MODEL_NAME = "grpo/tiny-qwen3-bpe"

TINY_TOOLS_MODEL_NAME = "grpo/tiny-qwen3-bpe-tools"
"""The built-in tiny model warm-started further on calculator tool calls (the --env tool task)."""
BUILTIN_MODEL_NAMES = (TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME)
