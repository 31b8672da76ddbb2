"""GSM8K-style rewards: boxed-answer extraction, answer normalization, grading.

- `extract_boxed`: the content of the last `\\boxed{...}` (nested braces matched).
- `normalize_answer`: the canonical form answers are compared in.
- `gsm8k_gold`: the gold answer of a GSM8K `answer` field (the text after `####`).
- `grade`: 1.0 when the response's boxed answer equals the gold answer, else 0.0.
- `extract_gold`: the gold answer of an answer field under a rule (`####`, whole, regex).
- `RewardInput`: what a reward callable may read besides the completion text and the row.
- `boxed_match`, `boxed_format`, `overlong_penalty`: the built-in reward callables.
- `weighted_total`: the weighted sum of reward components (docs/FORMULAS.md "Reward").

Normalization (docs/FORMULAS.md "Reward"): drop whitespace and LaTeX spacing (`\\,` `\\!` `\\;`
`\\:`), `$` and `\\$`, thousands separators (a comma or LaTeX `{,}` between digits followed
by exactly three digits), trailing periods; map Unicode minus and dash signs to `-`. What
is left is a number when it matches `[+-]?digits[.digits]`; numbers compare exactly as decimals
(`5` = `5.0` = `5.00`, `1,000` = `1000`, `-3` = `−3`, `-0` = `0`), everything else compares
as the normalized text.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import regex

__all__ = [
    "GOLD_RULES",
    "RewardInput",
    "boxed_format",
    "boxed_match",
    "extract_boxed",
    "extract_gold",
    "grade",
    "gsm8k_gold",
    "normalize_answer",
    "overlong_penalty",
    "soft_overlong_penalty",
    "weighted_total",
]

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


# --- gold answers -----------------------------------------------------------------------

GOLD_RULES = ("####", "whole")
"""Named gold-answer rules; any other rule is `regex:PATTERN` (group 1, else the whole match)."""


GOLD_RULE_TIMEOUT_S = 1.0


class GoldRuleTimeout(ValueError):
    """A `regex:PATTERN` gold rule past `GOLD_RULE_TIMEOUT_S` on one answer."""


def _matches(pattern: Any, text: str, timeout_s: float) -> list[Any]:
    """The non-overlapping matches of `pattern` in `text` (as `finditer`), within `timeout_s`
    in all (each search gets what is left); TimeoutError past it."""
    deadline = time.monotonic() + timeout_s
    matches: list[Any] = []
    position = 0
    while position <= len(text):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        match = pattern.search(text, position, timeout=left)
        if match is None:
            break
        matches.append(match)
        position = match.end() if match.end() > match.start() else match.end() + 1
    return matches


def extract_gold(answer_text: str, rule: str = "####") -> str:
    """The gold answer of an answer field: after the last `####`, the whole field, or a regex.

    `regex:PATTERN` takes the last match's group 1 (the whole match if the pattern has no
    group); ValueError names the rule when nothing is found, when the pattern is invalid,
    and (`GoldRuleTimeout`) when matching one answer takes over `GOLD_RULE_TIMEOUT_S`
    (the `regex` engine's timeout: a backtracking pattern cannot hang the run).
    """
    if rule == "####":
        return gsm8k_gold(answer_text)
    if rule == "whole":
        gold = answer_text.strip()
        if not gold:
            raise ValueError("answer is empty; --gold-rule whole needs a non-empty answer field")
        return gold
    if not rule.startswith("regex:"):
        raise ValueError(f"gold rule {rule!r} is not one of '####', 'whole' or 'regex:PATTERN'")
    try:
        pattern = regex.compile(rule.removeprefix("regex:"))
    except (regex.error, ValueError, OverflowError, RecursionError) as error:
        raise ValueError(
            f"--gold-rule {rule!r} is not a valid regular expression: {error}"
        ) from None
    try:
        matches = _matches(pattern, answer_text, GOLD_RULE_TIMEOUT_S)
    except TimeoutError:
        raise GoldRuleTimeout(
            f"--gold-rule {rule!r} did not finish within {GOLD_RULE_TIMEOUT_S:g} s on an answer "
            f"of {len(answer_text)} characters (a pattern such as (a+)+ backtracks without "
            "end); write it without nested repetition"
        ) from None
    if not matches:
        raise ValueError(
            f"--gold-rule {rule!r} finds nothing in the answer (ends with {answer_text[-80:]!r})"
        )
    last = matches[-1]
    gold = (last.group(1) if pattern.groups else last.group(0)).strip()
    if not gold:
        raise ValueError(f"--gold-rule {rule!r} matches an empty answer in {answer_text[-80:]!r}")
    return gold


# --- reward callables ---------------------------------------------------------------------


@attrs.frozen
class RewardInput:
    """What a reward may read besides the completion text and the dataset row.

    A reward callable takes `(completion, row)` or `(completion, row, sample)`; `sample` is
    this record. `index` is the row's index in its split, `gold` the answer extracted by
    --gold-rule, `num_tokens` the completion's length in tokens, `stop_reason` the
    sampler's ("length" when cut at `max_tokens`), `overlong_buffer` the L of DAPO's penalty.
    """

    index: int
    gold: str
    num_tokens: int
    max_tokens: int
    stop_reason: str
    overlong_buffer: int

    @property
    def truncated(self) -> bool:
        """True when the sampler stopped at `max_tokens`."""
        return self.stop_reason == "length"


def boxed_match(completion: str, row: Mapping[str, Any], sample: RewardInput) -> float:
    """1.0 when the last `\\boxed{}` answer equals the gold answer (`grade`), else 0.0."""
    return grade(completion, sample.gold)


def boxed_format(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 when the completion ends its answer in a complete, non-empty `\\boxed{}`, else 0.0."""
    answer = extract_boxed(completion)
    return float(answer is not None and bool(_strip_surface(answer)))


def soft_overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong penalty: 0 up to max_tokens − buffer, then −(len − (max − L)) / L.

    Linear from 0 at `max_tokens − buffer` tokens to −1 at `max_tokens` (and −1 beyond).
    """
    if buffer < 1 or max_tokens < 1:
        raise ValueError(f"overlong buffer {buffer} and max_tokens {max_tokens} must be >= 1")
    buffer = min(buffer, max_tokens)
    excess = num_tokens - (max_tokens - buffer)
    return -min(1.0, max(0.0, excess / buffer))


def overlong_penalty(completion: str, row: Mapping[str, Any], sample: RewardInput) -> float:
    """`soft_overlong_penalty` of the completion's length (--overlong-buffer tokens)."""
    return soft_overlong_penalty(sample.num_tokens, sample.max_tokens, sample.overlong_buffer)


def weighted_total(
    components: Mapping[str, npt.NDArray[np.float64]], weights: Mapping[str, float]
) -> npt.NDArray[np.float64]:
    """R = Σ_k w_k · r_k over the named components (one weight per component name).

    A lone component of weight 1 is returned unchanged (bit for bit).
    """
    if not components:
        raise ValueError("weighted_total needs at least one reward component")
    names = list(components)
    total = weights[names[0]] * np.asarray(components[names[0]], dtype=np.float64)
    for name in names[1:]:
        total = total + weights[name] * np.asarray(components[name], dtype=np.float64)
    return total
