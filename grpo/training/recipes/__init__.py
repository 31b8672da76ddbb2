"""The recipes the run lifecycle drives: ``grpo`` (GRPO and on-policy distillation, on
completions or episodes) and ``sft``; each step reads top to bottom in its own module."""
