"""A user-written reward for `grpo train --reward examples/my_rewards.py:brief=0.5`."""


def brief(completion: str, row: dict, sample) -> float:
    """1.0 for an answer in at most 10 tokens, fading linearly to 0.0 at 16 tokens.

    The built-in model's answers are 12-16 tokens long, so this reward bites on most of them.
    """
    return max(0.0, min(1.0, (16 - sample.num_tokens) / 6))
