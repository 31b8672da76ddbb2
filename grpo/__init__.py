"""grpo: run and study GRPO on LLMs, on the PyTRIO service or an embedded local backend."""

__version__ = "0.1.0"
