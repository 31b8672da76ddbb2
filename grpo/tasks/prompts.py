"""Prompt construction: a question becomes chat-template tokens that ask for a boxed answer.

The format follows the seed article: the question plus ``QUESTION_SUFFIX`` as the user turn,
optionally preceded by one worked few-shot exchange (``FEWSHOT_PREFIX``), rendered with the
tokenizer's chat template (generation prompt on, thinking off) and encoded without extra
special tokens. A ``PromptTemplate`` changes the parts (--system-prompt, --question-suffix,
--fewshot-file); the default template gives the article's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from grpo.core.messages import check_messages

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


@attrs.frozen
class PromptTemplate:
    """The parts of a prompt: an optional system message, few-shot messages, question suffix."""

    system_prompt: str | None = None
    question_suffix: str = QUESTION_SUFFIX
    fewshot_messages: tuple[tuple[str, str], ...] = tuple(
        (message["role"], message["content"]) for message in FEWSHOT_PREFIX
    )

    @classmethod
    def build(
        cls, *, system_prompt: str | None, question_suffix: str, fewshot_file: str | None
    ) -> PromptTemplate:
        """The template of the flags; ValueError naming --fewshot-file when it is unusable."""
        if fewshot_file is None:
            return cls(system_prompt=system_prompt, question_suffix=question_suffix)
        return cls(
            system_prompt=system_prompt,
            question_suffix=question_suffix,
            fewshot_messages=read_fewshot_file(Path(fewshot_file)),
        )


def read_fewshot_file(path: Path) -> tuple[tuple[str, str], ...]:
    """(role, content) pairs of a JSON list of {"role", "content"} chat messages."""
    example = '[{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]'
    try:
        messages = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--fewshot-file {str(path)!r} not found") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--fewshot-file {path} line {error.lineno} is not valid JSON ({error.msg}); "
            f"it holds a list of messages, e.g. {example}"
        ) from None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"--fewshot-file {path} must hold a non-empty list, e.g. {example}")
    checked = check_messages(messages, f"--fewshot-file {path}")
    return tuple((message["role"], message["content"]) for message in checked)


DEFAULT_TEMPLATE = PromptTemplate()


def build_messages(
    question: str, *, fewshot: bool, template: PromptTemplate = DEFAULT_TEMPLATE
) -> list[dict[str, str]]:
    """The chat messages: [system] + [few-shot messages] + user(question + suffix)."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(
            f"question must be a non-empty string, got {question!r}; "
            "check the dataset's question column (--prompt-column)"
        )
    system = (
        [{"role": "system", "content": template.system_prompt}]
        if template.system_prompt is not None
        else []
    )
    prefix = (
        [{"role": role, "content": content} for role, content in template.fewshot_messages]
        if fewshot
        else []
    )
    return [*system, *prefix, {"role": "user", "content": question + template.question_suffix}]


def build_prompt_tokens(
    tokenizer: Any, question: str, *, fewshot: bool, template: PromptTemplate = DEFAULT_TEMPLATE
) -> list[int]:
    """Token ids of chat_template(messages, add_generation_prompt=True, enable_thinking=False)."""
    prompt_text = tokenizer.apply_chat_template(
        build_messages(question, fewshot=fewshot, template=template),
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
