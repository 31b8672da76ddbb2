"""Grpo train: the GRPO recipe's step and its run."""
