"""Names of the built-in models, importable without torch (the CLI's defaults need them)."""

TINY_MODEL_NAME = "grpo/tiny-qwen3-bpe"
TINY_TOOLS_MODEL_NAME = "grpo/tiny-qwen3-bpe-tools"
"""The built-in tiny model warm-started further on calculator tool calls (the --env tool task)."""
BUILTIN_MODEL_NAMES = (TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME)
