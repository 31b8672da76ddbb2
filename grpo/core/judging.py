"""Judge rewards: rubric rendering, strict reply parsing, the rank -> reward rule, cache keys.

docs/FORMULAS.md, "Judge rewards". Pure functions; the judge's calls, cache file and usage
are the shell's (`grpo/judge.py`).

- `render_rubric`: the rubric with `{question}`, `{completion}`, `{completions}` and
  `{reference}` filled in, one pass, left to right (filled-in text is never re-read).
- `parse_score`: the reply's last non-empty line `SCORE: s[/S]` -> s / S in [0, 1], else
  `JudgeFormatError` (never a silent 0).
- `parse_ranking`: the last non-empty line `RANKING: 2 > 1 = 3 > ...` -> tiers of labels
  1..G, each exactly once, else `JudgeFormatError`.
- `rank_rewards`: r_i = (G - rho_i) / (G - 1), rho_i the fractional rank of i's tier.
- `cache_key`: sha256 of (judge, rubric, prompt, completions).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from grpo.core.rewards import RewardInput

__all__ = [
    "DEFAULT_RANK_RUBRIC",
    "DEFAULT_SCORE_RUBRIC",
    "JudgeFormatError",
    "JudgeGroup",
    "PLACEHOLDERS",
    "cache_key",
    "format_group",
    "parse_ranking",
    "parse_score",
    "rank_rewards",
    "render_rubric",
]

PLACEHOLDERS = ("question", "completion", "completions", "reference")
NO_REFERENCE = "(none)"
MAX_REPLY_CHARS = 20_000
"""A reply longer than this is not parsed (a judge states its verdict in a few lines)."""

DEFAULT_SCORE_RUBRIC = """You grade an answer to a question.

Question:
{question}

Reference answer (may be "(none)"):
{reference}

Answer to grade:
{completion}

Judge whether the answer is correct and well reasoned. Reply with a short justification,
then end with one line of exactly this form, s a number from 0 (wrong) to 10 (perfect):
SCORE: s"""

DEFAULT_RANK_RUBRIC = """You compare several answers to one question.

Question:
{question}

Reference answer (may be "(none)"):
{reference}

Answers:
{completions}

Rank the answers from best to worst. Reply with a short justification, then end with one
line of exactly this form, every answer's number once, ">" meaning better and "=" equal:
RANKING: 2 > 1 = 3 > 4"""

_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_SCORE_LINE = re.compile(rf"^\s*score\s*:\s*({_NUMBER})\s*(?:/\s*({_NUMBER}))?\s*$", re.I)
_RANKING_LINE = re.compile(r"^\s*ranking\s*:\s*(.*?)\s*$", re.I)


@attrs.frozen
class JudgeGroup:
    """One group as the judge rewards get it: the row, each completion and its RewardInput."""

    row: Mapping[str, Any] = attrs.field(eq=False)
    completions: tuple[str, ...]
    samples: tuple[RewardInput, ...]


class JudgeFormatError(ValueError):
    """A judge reply that is not in the stated format (counted in judge/parse_errors)."""


def render_rubric(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each `{name}` of `PLACEHOLDERS` replaced by ``values[name]``, one pass.

    A placeholder missing from ``values`` is left as written; braces of any other form (a
    `\\boxed{}` in the rubric, a brace in a completion) are text.
    """
    return _PLACEHOLDER.sub(lambda match: values.get(match.group(1), match.group(0)), template)


def format_group(completions: Sequence[str]) -> str:
    """The group as the judge sees it: `[1]` .. `[G]`, each followed by its completion."""
    return "\n\n".join(f"[{i}]\n{text}" for i, text in enumerate(completions, start=1))


def _last_line(reply: str) -> str:
    if len(reply) > MAX_REPLY_CHARS:
        raise JudgeFormatError(f"the reply has {len(reply)} characters (> {MAX_REPLY_CHARS})")
    lines = [line for line in reply.splitlines() if line.strip()]
    if not lines:
        raise JudgeFormatError("the reply is empty")
    return lines[-1]


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_score(reply: str, max_score: float) -> float:
    """s / S of the reply's last non-empty line `SCORE: s` or `SCORE: s/S` (0 <= s <= S).

    JudgeFormatError when that line is not of this form, when another line also states a
    score, when s > S or when a stated `/S'` is not `--judge-max-score`.
    """
    last = _last_line(reply)
    match = _SCORE_LINE.match(last)
    if match is None:
        raise JudgeFormatError(f"the last line {_preview(last)} is not 'SCORE: <number>'")
    if sum(1 for line in reply.splitlines() if _SCORE_LINE.match(line)) > 1:
        raise JudgeFormatError("the reply states more than one SCORE line")
    score = float(match.group(1))
    if match.group(2) is not None and float(match.group(2)) != max_score:
        raise JudgeFormatError(
            f"the score is out of {match.group(2)}, not out of --judge-max-score {max_score:g}"
        )
    if score > max_score:
        raise JudgeFormatError(f"the score {score:g} is above --judge-max-score {max_score:g}")
    return score / max_score


def parse_ranking(reply: str, size: int) -> tuple[tuple[int, ...], ...]:
    """The tiers (best first) of the last non-empty line `RANKING: a > b = c > ...`.

    Labels are 1..``size``; JudgeFormatError unless every label appears exactly once.
    """
    last = _last_line(reply)
    match = _RANKING_LINE.match(last)
    if match is None:
        raise JudgeFormatError(f"the last line {_preview(last)} is not 'RANKING: 2 > 1 = 3 ...'")
    tiers = []
    for tier in match.group(1).split(">"):
        labels = [label.strip() for label in tier.split("=")]
        if not all(re.fullmatch(r"[0-9]{1,6}", label) for label in labels):
            raise JudgeFormatError(
                f"the ranking {_preview(match.group(1))} holds {_preview(tier.strip())}, not "
                "answer numbers joined by '=' (ties) and '>'"
            )
        tiers.append(tuple(int(label) for label in labels))
    seen = [label for tier in tiers for label in tier]
    if sorted(seen) != list(range(1, size + 1)):
        raise JudgeFormatError(
            f"the ranking {_preview(match.group(1))} does not name each answer 1..{size} "
            "exactly once"
        )
    return tuple(tiers)


def rank_rewards(tiers: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """r_i = (G - rho_i) / (G - 1), rho_i the mean position of i's tier (labels 1..G = size)."""
    if size < 2:
        raise ValueError(f"a ranking needs at least 2 answers, got {size}")
    rewards_G = np.zeros(size, dtype=np.float64)
    before = 0
    for tier in tiers:
        rank = before + (len(tier) + 1) / 2
        for label in tier:
            rewards_G[label - 1] = (size - rank) / (size - 1)
        before += len(tier)
    return rewards_G


def cache_key(judge: str, rubric: str, prompt: str, completions: Sequence[str]) -> str:
    """sha256 hex of (judge, rubric, prompt, completions), JSON-encoded (no separator clashes)."""
    blob = json.dumps([judge, rubric, prompt, list(completions)], ensure_ascii=True)
    return hashlib.sha256(blob.encode("ascii")).hexdigest()
