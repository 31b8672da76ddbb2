"""Grpo dpo: its config, preference rows, reference cache, recipe."""
