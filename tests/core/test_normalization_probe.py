"""The normalization probe's decision (grpo/core/normalization_probe.py) and the totals it
reads (grpo/core/normalization.py; docs/FORMULAS.md,
"Service normalization", the probe)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from grpo.core.normalization import NORMALIZATIONS, BatchTotals
from grpo.core.normalization_probe import (
    DEFAULT_TOLERANCE,
    decide_convention,
    expected_scale_ratios,
)

totals = st.builds(
    BatchTotals,
    samples=st.integers(1, 64),
    active_tokens=st.integers(0, 4096),
    advantage_tokens=st.integers(0, 4096),
)


@given(
    first=totals,
    second=totals,
    convention=st.sampled_from(NORMALIZATIONS),
    multiplier=st.sampled_from([-2.0, -1.0, 0.5, 3.0]),
    first_response=st.floats(1e-6, 1e6),
    noise=st.floats(-0.9, 0.9),
)
def test_responses_scaled_as_a_convention_predicts_name_it(
    first, second, convention, multiplier, first_response, noise
):
    expected = expected_scale_ratios(first, second)
    others = [name for name in NORMALIZATIONS if name != convention]
    # Only designs where the other conventions predict something clearly different decide.
    assume(
        all(
            abs(math.log(expected[name] / expected[convention])) > 2 * DEFAULT_TOLERANCE
            for name in others
        )
    )
    # The second response as `convention` predicts it, off by less than the tolerance.
    second_response = (
        first_response * multiplier * expected[convention] * math.exp(noise * DEFAULT_TOLERANCE)
    )
    verdict = decide_convention(first_response, second_response, first, second, multiplier)
    assert verdict.convention == convention, verdict.describe()
    assert verdict.measured == pytest.approx(second_response / first_response / multiplier)
    assert verdict.describe().startswith(convention)


@given(
    first=totals,
    second=totals,
    first_response=st.floats(1e-6, 1e6),
    factor=st.floats(1.3, 100.0),
    below=st.booleans(),
)
def test_a_ratio_far_from_every_prediction_is_unknown(first, second, first_response, factor, below):
    expected = expected_scale_ratios(first, second)
    # A ratio `factor` beyond the nearest prediction (above or below every one of them).
    measured = min(expected.values()) / factor if below else max(expected.values()) * factor
    verdict = decide_convention(
        first_response, first_response * -2.0 * measured, first, second, -2.0
    )
    assert verdict.convention is None
    assert verdict.describe().startswith("unknown (no convention matches")


def test_equal_predictions_are_ambiguous_not_a_guess():
    same = BatchTotals(samples=2, active_tokens=8, advantage_tokens=8)
    verdict = decide_convention(1.0, 1.0, same, same, 1.0)
    assert verdict.convention is None
    assert "ambiguous" in verdict.reason


@pytest.mark.parametrize(
    ("first_response", "second_response", "reason"),
    [
        (0.0, -1.0, "did not raise"),
        (-0.5, 1.0, "did not raise"),
        (1.0, 1.0, "wrong way"),  # the multiplier is -2: the second must come back
        (1.0, math.nan, "not finite"),
    ],
)
def test_responses_that_measure_nothing_are_unknown(first_response, second_response, reason):
    verdict = decide_convention(
        first_response,
        second_response,
        BatchTotals(1, 4, 4),
        BatchTotals(4, 32, 8),
        -2.0,
    )
    assert verdict.convention is None
    assert reason in verdict.reason


def test_the_denominators_follow_the_local_backend():
    totals_ = BatchTotals(samples=3, active_tokens=0, advantage_tokens=7)
    assert [totals_.denominator(name) for name in NORMALIZATIONS] == [1.0, 1.0, 7.0, 3.0]
    assert [totals_.gradient_scale(name) for name in NORMALIZATIONS] == [1.0, 1.0, 1 / 7, 1 / 3]
    with pytest.raises(ValueError, match="active_tokens"):
        totals_.denominator("mean")
    with pytest.raises(ValueError, match="gradient_multiplier"):
        decide_convention(1.0, 1.0, totals_, totals_, 0.0)
