"""GSM8K-style rewards: boxed-answer extraction, answer normalization, grading.

- `extract_boxed`: the content of the last `\\boxed{...}` (nested braces matched).
- `normalize_answer`: the canonical form answers are compared in.
- `gsm8k_gold`: the gold answer of a GSM8K `answer` field (the text after `####`).
- `grade`: 1.0 when the response's boxed answer equals the gold answer, else 0.0.

Normalization (docs/FORMULAS.md "Reward"): drop whitespace and LaTeX spacing (`\\,` `\\!` `\\;`
`\\:`), `$` and `\\$`, thousands separators (a comma or LaTeX `{,}` between digits followed
by exactly three digits), trailing periods; map Unicode minus and dash signs to `-`. What
is left is a number when it matches `[+-]?digits[.digits]`; numbers compare exactly as decimals
(`5` = `5.0` = `5.00`, `1,000` = `1000`, `-3` = `−3`, `-0` = `0`), everything else compares
as the normalized text.
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["extract_boxed", "grade", "gsm8k_gold", "normalize_answer"]

_BOXED_OPEN = "\\boxed{"
_MINUS_SIGNS = str.maketrans(
    {"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"}
)
_LATEX_SPACING = re.compile(r"\\[,!;:]")
_WHITESPACE = re.compile(r"\s+")
# Only a comma between a digit and a group of exactly three digits is a thousands
# separator; "1,2" or "12,34" (lists, decimal commas) keep theirs and stay text.
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in text, braces matched; None if absent or unbalanced."""
    start = text.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    content_start = start + len(_BOXED_OPEN)
    depth = 1
    for index in range(content_start, len(text)):
        character = text[index]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:index]
    return None


def _strip_surface(text: str) -> str:
    """Remove what does not change an answer's value: spaces, `$`, separators, trailing periods."""
    text = text.translate(_MINUS_SIGNS)
    text = _LATEX_SPACING.sub("", text)
    text = _WHITESPACE.sub("", text)
    text = text.replace("\\$", "").replace("$", "")
    # `{,}` is how LaTeX math mode writes a comma without its trailing space: `1{,}000`.
    text = _THOUSANDS_SEPARATOR.sub("", text.replace("{,}", ","))
    return text.rstrip(".")


def _parse_decimal(stripped: str) -> Decimal | None:
    if _DECIMAL_NUMBER.fullmatch(stripped) is None:
        return None
    return Decimal(stripped)


def _canonical_decimal(value: Decimal) -> str:
    if value == 0:
        return "0"
    digits = format(value, "f")
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return digits


def normalize_answer(text: str) -> str:
    """Canonical answer: the exact decimal of a number (`1,000.50` -> `1000.5`), else the text."""
    stripped = _strip_surface(text)
    number = _parse_decimal(stripped)
    return stripped if number is None else _canonical_decimal(number)


def gsm8k_gold(answer_text: str) -> str:
    """The gold answer of a GSM8K `answer` field: the text after its last `####`, stripped."""
    marker = "####"
    if marker not in answer_text:
        preview = answer_text[-80:]
        raise ValueError(
            f"GSM8K answer has no '####' marker (ends with {preview!r}); pass the dataset's "
            "`answer` field, whose last line is '#### <number>'"
        )
    gold = answer_text.rpartition(marker)[2].strip()
    if not gold:
        raise ValueError(
            f"GSM8K answer has nothing after its '####' marker (ends with {answer_text[-80:]!r}); "
            "the gold answer must follow '####'"
        )
    return gold


def grade(response: str, gold: str) -> float:
    """1.0 when the last `\\boxed{}` answer of response equals gold after normalization, else 0.0.

    A response without a complete `\\boxed{}` or with an empty one scores 0.0.
    """
    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    answer_stripped, gold_stripped = _strip_surface(answer), _strip_surface(gold)
    if not answer_stripped:
        return 0.0
    answer_number, gold_number = _parse_decimal(answer_stripped), _parse_decimal(gold_stripped)
    if answer_number is not None and gold_number is not None:
        return float(answer_number == gold_number)
    return float(answer_stripped == gold_stripped)
