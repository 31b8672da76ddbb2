"""Names of the built-in models, importable without torch (the CLI's defaults need them)."""

TINY_MODEL_NAME = "grpo/tiny-qwen3-bpe"
