"""Prompt construction: a question becomes chat-template tokens that ask for a boxed answer.

The format follows the seed article: the question plus ``QUESTION_SUFFIX`` as the user turn,
optionally preceded by one worked few-shot exchange (``FEWSHOT_PREFIX``), rendered with the
tokenizer's chat template (generation prompt on, thinking off) and encoded without extra
special tokens.
"""

from __future__ import annotations

from typing import Any

QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."

# One worked example that shows the answer format: reason briefly, end with the boxed number.
FEWSHOT_PREFIX: tuple[dict[str, str], ...] = (
    {
        "role": "user",
        "content": "How many times does the letter r appear in strawberry?" + QUESTION_SUFFIX,
    },
    {
        "role": "assistant",
        "content": (
            "Spelling the word one letter at a time: "
            "s (1), t (2), r (3), a (4), w (5), b (6), e (7), r (8), r (9), y (10). "
            "The letter r is at positions 3, 8 and 9, so it appears three times. \\boxed{3}"
        ),
    },
)


def build_messages(question: str, *, fewshot: bool) -> list[dict[str, str]]:
    """The chat messages for one question: [few-shot exchange] + user(question + suffix)."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(
            f"question must be a non-empty string, got {question!r}; "
            "check the dataset's `question` column"
        )
    prefix = [dict(message) for message in FEWSHOT_PREFIX] if fewshot else []
    return [*prefix, {"role": "user", "content": question + QUESTION_SUFFIX}]


def build_prompt_tokens(tokenizer: Any, question: str, *, fewshot: bool) -> list[int]:
    """Token ids of chat_template(messages, add_generation_prompt=True, enable_thinking=False)."""
    prompt_text = tokenizer.apply_chat_template(
        build_messages(question, fewshot=fewshot),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt_tokens = list(tokenizer.encode(prompt_text, add_special_tokens=False))
    if not prompt_tokens:
        raise ValueError(
            f"the prompt for question {question!r} encoded to zero tokens; "
            f"the tokenizer's chat template rendered {prompt_text!r}"
        )
    return prompt_tokens
