"""Grpo sft: its config, its rows and its recipe."""
