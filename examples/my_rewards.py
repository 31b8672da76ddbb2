"""A user-written reward for `grpo train --reward examples/my_rewards.py:brief=0.5`."""


def brief(completion: str, row: dict, sample) -> float:
    """1.0 for an answer in at most 18 tokens, fading linearly to 0.0 at 24 tokens."""
    return max(0.0, min(1.0, (24 - sample.num_tokens) / 6))
