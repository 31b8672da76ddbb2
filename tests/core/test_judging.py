"""Judge replies parsed strictly, the rank -> reward rule against docs/FORMULAS.md, rubrics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.judging import (
    JudgeFormatError,
    cache_key,
    format_group,
    parse_ranking,
    parse_score,
    rank_rewards,
    render_rubric,
)

PROSE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80).filter(
    lambda text: "score" not in text.lower() and "ranking" not in text.lower()
)


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


@given(
    st.floats(0, 100, allow_nan=False),
    st.sampled_from([1.0, 5.0, 10.0, 100.0]),
    PROSE,
    st.sampled_from(
        ["SCORE: {}", "score:{}", "  Score :  {}  ", "SCORE: {}/{S}", "SCORE: {} / {S}"]
    ),
)
def test_a_stated_score_parses_to_s_over_S(
    raw: float, max_score: float, prose: str, form: str
) -> None:
    score = min(float(_number(raw)), max_score)
    line = form.format(_number(score), S=_number(max_score))
    assert parse_score(f"{prose}\n{line}\n\n", max_score) == pytest.approx(score / max_score)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "   \n  ",
        "7",
        "The answer deserves a 7.",
        "SCORE: 7\nThat is my verdict.",  # not the last line
        "SCORE: 3\nSCORE: 7",  # two verdicts
        "SCORE: 11",  # above S = 10
        "SCORE: -1",
        "SCORE: 7/5",  # out of another S
        "SCORE: 7.5.1",
        "SCORE: seven",
        "SCORE: 1e1",
        "SCORE: 70%",
        "SCORE: 7 (good)",
    ],
)
def test_anything_else_is_a_format_error_never_a_zero(reply: str) -> None:
    with pytest.raises(JudgeFormatError):
        parse_score(reply, 10.0)


def test_an_overlong_reply_is_not_parsed() -> None:
    with pytest.raises(JudgeFormatError, match="characters"):
        parse_score("x" * 30_000 + "\nSCORE: 5", 10.0)


@st.composite
def rankings(draw: st.DrawFn) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(G, tiers): a random ordering of 1..G cut into tiers of ties."""
    size = draw(st.integers(2, 12))
    order = draw(st.permutations(list(range(1, size + 1))))
    cuts = sorted(draw(st.sets(st.integers(1, size - 1))))
    bounds = [0, *cuts, size]
    return size, tuple(tuple(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _line(tiers: tuple[tuple[int, ...], ...], gap: str) -> str:
    return f"RANKING:{gap}" + f"{gap}>{gap}".join(f"{gap}={gap}".join(map(str, t)) for t in tiers)


@given(rankings(), st.sampled_from(["", " ", "  "]), PROSE)
def test_a_stated_ranking_parses_back_to_its_tiers(
    ranking: tuple[int, tuple[tuple[int, ...], ...]], gap: str, prose: str
) -> None:
    size, tiers = ranking
    assert parse_ranking(f"{prose}\n{_line(tiers, gap)}", size) == tiers


@pytest.mark.parametrize(
    "line",
    [
        "RANKING: 1 > 2",  # 3 missing
        "RANKING: 1 > 2 > 3 > 3",  # 3 twice
        "RANKING: 1 > 2 > 4",  # 4 is no answer
        "RANKING: 1 > > 2 > 3",
        "RANKING: 1, 2, 3",
        "RANKING: [1] > [2] > [3]",
        "RANKING: 1 > 2 > 3 > 0",
        "1 > 2 > 3",
    ],
)
def test_a_ranking_that_is_not_a_permutation_is_a_format_error(line: str) -> None:
    with pytest.raises(JudgeFormatError):
        parse_ranking(f"thinking...\n{line}", 3)


def _reference_rewards(tiers: tuple[tuple[int, ...], ...], size: int) -> list[float]:
    """FORMULAS: rho_i = the mean of the positions 1..G its tier occupies; r = (G - rho)/(G - 1)."""
    positions = {}
    position = 1
    for tier in tiers:
        occupied = list(range(position, position + len(tier)))
        for label in tier:
            positions[label] = sum(occupied) / len(occupied)
        position += len(tier)
    return [(size - positions[label]) / (size - 1) for label in range(1, size + 1)]


@given(rankings())
def test_rank_rewards_follow_the_formula_and_sum_to_half_the_group(
    ranking: tuple[int, tuple[tuple[int, ...], ...]],
) -> None:
    size, tiers = ranking
    rewards_G = rank_rewards(tiers, size)
    np.testing.assert_allclose(rewards_G, _reference_rewards(tiers, size), atol=1e-12)
    assert rewards_G.sum() == pytest.approx(size / 2)
    assert rewards_G.min() >= 0 and rewards_G.max() <= 1


def test_a_strict_ranking_gives_the_best_1_and_the_worst_0() -> None:
    np.testing.assert_allclose(rank_rewards(((3,), (1,), (2,)), 3), [0.5, 0.0, 1.0])
    np.testing.assert_allclose(rank_rewards(((1, 2, 3, 4),), 4), [0.5] * 4)


def test_rubrics_fill_each_placeholder_once_and_leave_other_braces() -> None:
    template = "Q: {question}\nA: {completion}\nref {reference} \\boxed{} {unknown}"
    text = render_rubric(
        template, {"question": "{completion}", "completion": "x {reference}", "reference": "7"}
    )
    assert text == "Q: {completion}\nA: x {reference}\nref 7 \\boxed{} {unknown}"
    assert format_group(["a", "b"]) == "[1]\na\n\n[2]\nb"


def test_cache_keys_differ_in_every_part() -> None:
    base = ("judge", "rubric", "prompt", ["c1", "c2"])
    keys = {cache_key(*base)}
    for index, changed in enumerate(("judge2", "rubric2", "prompt2", ["c1", "c3"])):
        parts = list(base)
        parts[index] = changed
        keys.add(cache_key(*parts))
    keys.add(cache_key("judge", "rubric", "prompt", ["c1c2"]))
    assert len(keys) == 6
