"""Tests for grpo.core.rewards: boxed extraction, normalization, GSM8K gold, grading."""

from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core import rewards as core_rewards
from grpo.core.rewards import extract_boxed, grade, gsm8k_gold, normalize_answer
from tests.strategies import answer_numbers, boxed_responses, number_surface_forms


def _balanced_braces() -> st.SearchStrategy[str]:
    plain = st.text(alphabet="ab1 +^\\", max_size=4)
    return st.recursive(
        plain,
        lambda inner: st.builds(lambda a, b, c: a + "{" + b + "}" + c, plain, inner, plain),
        max_leaves=6,
    )


@given(
    content=_balanced_braces(),
    prefix=st.text(max_size=20),
    suffix=st.text(alphabet="ab }{.", max_size=10),
)
def test_extract_boxed_returns_the_balanced_content_of_the_last_box(content, prefix, suffix):
    assert extract_boxed(prefix + "\\boxed{" + content + "}" + suffix) == content


def test_extract_boxed_matches_nested_braces():
    assert extract_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"


def test_extract_boxed_takes_the_last_box():
    assert extract_boxed("\\boxed{3} no wait \\boxed{4}.") == "4"


def test_extract_boxed_without_a_box_is_none():
    assert extract_boxed("the answer is 4") is None


def test_extract_boxed_of_an_unbalanced_last_box_is_none():
    assert extract_boxed("\\boxed{3} then \\boxed{\\frac{1}{2}") is None


@given(value=answer_numbers(), data=st.data())
def test_every_surface_form_normalizes_to_the_same_number(value, data):
    form = data.draw(number_surface_forms(value))
    assert Decimal(normalize_answer(form)) == value
    assert normalize_answer(form) == normalize_answer(format(value, "f"))


@given(value=answer_numbers(), data=st.data())
def test_a_boxed_surface_form_grades_one_against_the_canonical_answer(value, data):
    response = data.draw(boxed_responses(data.draw(number_surface_forms(value))))
    assert grade(response, format(value, "f")) == 1.0


@given(value=answer_numbers(), data=st.data())
def test_two_surface_forms_of_one_number_grade_one(value, data):
    response = data.draw(boxed_responses(data.draw(number_surface_forms(value))))
    gold = data.draw(number_surface_forms(value))
    assert grade(response, gold) == 1.0


@given(value=answer_numbers(), other=answer_numbers(), data=st.data())
def test_a_different_number_grades_zero(value, other, data):
    if other == value:
        other = value + 1
    response = data.draw(boxed_responses(data.draw(number_surface_forms(other))))
    assert grade(response, format(value, "f")) == 0.0


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("5", "5.00"),
        ("5.", "5"),
        ("$5", "5"),
        ("1,000", "1000"),
        (" 1000 ", "1,000"),
        ("\u22123", "-3"),
        ("1{,}234{,}567", "1234567"),
        ("\\$ 12.50", "12.5"),
        ("-0", "0"),
    ],
)
def test_documented_equal_forms_grade_one(answer, gold):
    assert grade(f"so \\boxed{{{answer}}}", gold) == 1.0


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("3", "-3"),
        ("1,2", "12"),
        ("12,34", "1234"),
        ("5.01", "5"),
        ("1000", "100"),
    ],
)
def test_documented_different_forms_grade_zero(answer, gold):
    assert grade(f"\\boxed{{{answer}}}", gold) == 0.0


def test_text_answers_compare_as_normalized_text():
    assert grade("\\boxed{ Monday. }", "Monday") == 1.0
    assert grade("\\boxed{Monday}", "Tuesday") == 0.0


def test_numbers_compare_exactly_not_within_a_float_tolerance():
    assert grade("\\boxed{0.30000000000000001}", "0.3") == 0.0
    assert grade("\\boxed{10000000000000001}", "10000000000000000") == 0.0


def test_a_response_without_a_box_or_with_an_empty_box_grades_zero():
    assert grade("The answer is 5.", "5") == 0.0
    assert grade("\\boxed{}", "") == 0.0
    assert grade("\\boxed{5", "5") == 0.0


def test_gsm8k_gold_is_the_text_after_the_marker():
    assert gsm8k_gold("She pays 2 * 500 = <<2*500=1000>>1000.\n#### 1,000 ") == "1,000"


def test_gsm8k_gold_without_marker_names_the_marker_and_the_fix():
    with pytest.raises(ValueError, match="no '####' marker.*pass the dataset's `answer` field"):
        gsm8k_gold("The answer is 5")


def test_gsm8k_gold_with_nothing_after_the_marker_is_an_error():
    with pytest.raises(ValueError, match="nothing after its '####' marker"):
        gsm8k_gold("work\n####  ")


# --- gold rules, built-in reward callables, weighted totals -----------------------------------


@pytest.mark.parametrize(
    "answer, rule, gold",
    [
        ("3 + 4 = 7\n#### 7", "####", "7"),
        ("  42 \n", "whole", "42"),
        ("so the answer is 12, not 13", r"regex:answer is (\d+)", "12"),
        ("a 1 b 2 c 3", r"regex:\d", "3"),
    ],
)
def test_extract_gold_follows_its_rule(answer, rule, gold):
    assert core_rewards.extract_gold(answer, rule) == gold


@pytest.mark.parametrize(
    "answer, rule, message",
    [
        ("no marker", "####", "no '####' marker"),
        ("  ", "whole", "empty"),
        ("abc", r"regex:(\d+)", "finds nothing"),
        ("x", "bogus", "not one of"),
    ],
)
def test_extract_gold_errors_name_the_rule(answer, rule, message):
    with pytest.raises(ValueError, match=message):
        core_rewards.extract_gold(answer, rule)


@given(max_tokens=st.integers(1, 200), buffer=st.integers(1, 200), data=st.data())
def test_soft_overlong_penalty_is_zero_then_linear_down_to_minus_one(max_tokens, buffer, data):
    length = data.draw(st.integers(1, max_tokens))
    penalty = core_rewards.soft_overlong_penalty(length, max_tokens, buffer)
    start = max_tokens - min(buffer, max_tokens)
    assert -1.0 <= penalty <= 0.0
    if length <= start:
        assert penalty == 0.0
    else:
        assert penalty == pytest.approx(-(length - start) / min(buffer, max_tokens))
    assert core_rewards.soft_overlong_penalty(max_tokens, max_tokens, buffer) == -1.0


def test_soft_overlong_penalty_of_dapo_numbers():
    # DAPO: L_max 20480 with a 4096 buffer: 0 up to 16384 tokens, -0.5 at 18432, -1 at 20480.
    assert core_rewards.soft_overlong_penalty(16384, 20480, 4096) == 0.0
    assert core_rewards.soft_overlong_penalty(18432, 20480, 4096) == -0.5
    assert core_rewards.soft_overlong_penalty(20480, 20480, 4096) == -1.0


def _sample(**overrides):
    values = dict(
        index=0, gold="7", num_tokens=5, max_tokens=24, stop_reason="stop", overlong_buffer=6
    )
    return core_rewards.RewardInput(**{**values, **overrides})


def test_builtin_reward_callables():
    assert core_rewards.boxed_match("so \\boxed{7}", {}, _sample()) == 1.0
    assert core_rewards.boxed_match("so \\boxed{8}", {}, _sample()) == 0.0
    assert core_rewards.boxed_format("so \\boxed{8}", {}) == 1.0
    assert core_rewards.boxed_format("so \\boxed{ }", {}) == 0.0
    assert core_rewards.boxed_format("so 8", {}) == 0.0
    assert core_rewards.overlong_penalty("", {}, _sample(num_tokens=21)) == -0.5
    assert _sample(stop_reason="length").truncated and not _sample().truncated


def test_weighted_total_is_the_weighted_sum_and_a_lone_unit_weight_is_exact():
    components = {"a": np.array([1.0, 0.0, 1.0]), "b": np.array([0.5, 0.25, 0.0])}
    total = core_rewards.weighted_total(components, {"a": 1.0, "b": -2.0})
    assert total.tolist() == [0.0, -0.5, 1.0]
    lone = np.array([0.1, 0.7])
    assert core_rewards.weighted_total({"a": lone}, {"a": 1.0}).tobytes() == lone.tobytes()


def test_a_backtracking_gold_rule_stops_within_its_time_bound_naming_the_rule():
    import time

    from grpo.core.rewards import GOLD_RULE_TIMEOUT_S, GoldRuleTimeout, extract_gold

    for answer, rule in (("a" * 40 + "!", r"regex:(a|aa)+$"), ("a" * 5000 + "!", r"regex:(a+)+$")):
        start = time.monotonic()
        with pytest.raises(GoldRuleTimeout, match=r"did not finish within 1 s.*nested repetition"):
            extract_gold(answer, rule)
        assert time.monotonic() - start < 4 * GOLD_RULE_TIMEOUT_S
    with pytest.raises(ValueError, match="not a valid regular expression"):
        extract_gold("x", "regex:(")
    assert extract_gold("x = 5, y = 7", r"regex:= (\d)") == "7"
