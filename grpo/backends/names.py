"""Names the CLI's defaults need, importable without torch: the built-in models, and the
local trainer's service normalizations (docs/FORMULAS.md, "Service normalization")."""

TINY_MODEL_NAME = "grpo/tiny-qwen3-bpe"

SERVICE_NORMALIZATIONS = ("sum", "active_tokens", "advantage_tokens", "samples")
"""The gradient scales of the local trainer: the loss as it is (``sum``), or divided by the
logical batch's active tokens, advantage tokens or samples (pytrio's
``gradient_accumulation``)."""

TINY_TOOLS_MODEL_NAME = "grpo/tiny-qwen3-bpe-tools"
"""The built-in tiny model warm-started further on calculator tool calls (the --env tool task)."""
BUILTIN_MODEL_NAMES = (TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME)
