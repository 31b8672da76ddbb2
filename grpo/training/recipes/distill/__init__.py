"""Grpo distill: on-policy distillation and its teacher."""
