"""The loss-normalization probe's decision: two measured gradient responses -> a convention.

A service may divide a built-in loss's gradient by one of the totals pytrio sends with a
logical batch (``gradient_accumulation``): nothing (``sum``), the active tokens T, the
advantage tokens T_A or the samples S. The probe (the shell's
``grpo.backends.normalization_probe``) trains two crafted batches whose summed gradients
differ by a known factor m (``gradient_multiplier``) and whose totals differ in a known way,
and measures each batch's response: the change of the log-probs it trains, per unit of step
size. A convention with denominator D predicts the response ratio r2 / r1 = m · D1 / D2,
so the scale ratio s = (r2 / r1) / m names it: the convention whose D1 / D2 is nearest to s
in log space, when within `tolerance` and no other is (docs/FORMULAS.md, "Service
normalization", the probe). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from grpo.core.normalization import NORMALIZATIONS, BatchTotals

DEFAULT_TOLERANCE = math.log(1.25)
"""Largest |log(measured / expected)| the probe accepts: within a factor 1.25."""


def expected_scale_ratios(first: BatchTotals, second: BatchTotals) -> dict[str, float]:
    """D_first / D_second for every convention: the predicted scale ratio of the two batches."""
    return {
        convention: first.denominator(convention) / second.denominator(convention)
        for convention in NORMALIZATIONS
    }


@attrs.frozen
class ProbeVerdict:
    """What the probe concluded: the `convention` (None: unknown), the measured scale ratio,
    every convention's expected one, and the reason when unknown."""

    convention: str | None
    measured: float
    expected: Mapping[str, float]
    reason: str = ""

    def describe(self) -> str:
        """One line for a log: the convention and the evidence, or "unknown (...)"."""
        expected = ", ".join(f"{name} {value:.4g}" for name, value in self.expected.items())
        evidence = f"measured scale ratio {self.measured:.4g}; expected {expected}"
        if self.convention is None:
            return f"unknown ({self.reason}; {evidence})"
        return f"{self.convention} ({evidence})"


def decide_convention(
    first_response: float,
    second_response: float,
    first: BatchTotals,
    second: BatchTotals,
    gradient_multiplier: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> ProbeVerdict:
    """The convention whose D1 / D2 matches (second_response / first_response) / multiplier
    within `tolerance` in log space and alone does; else a verdict with convention None."""
    if not (tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance must be finite and > 0, got {tolerance!r}")
    if gradient_multiplier == 0 or not math.isfinite(gradient_multiplier):
        raise ValueError(
            f"gradient_multiplier must be finite and non-zero, got {gradient_multiplier!r}"
        )
    expected = expected_scale_ratios(first, second)
    values = (first_response, second_response)
    if not all(math.isfinite(value) for value in values):
        return ProbeVerdict(None, math.nan, expected, f"a response is not finite: {values}")
    if first_response <= 0:
        return ProbeVerdict(
            None,
            math.nan,
            expected,
            f"the first batch did not raise its log-probs ({first_response:.4g})",
        )
    measured = second_response / first_response / gradient_multiplier
    if measured <= 0:
        return ProbeVerdict(
            None, measured, expected, "the second batch moved the log-probs the wrong way"
        )
    distance = {name: abs(math.log(measured / value)) for name, value in expected.items()}
    matches = sorted(
        (name for name in NORMALIZATIONS if distance[name] <= tolerance), key=distance.get
    )
    if not matches:
        return ProbeVerdict(None, measured, expected, "no convention matches within tolerance")
    if len(matches) > 1:
        return ProbeVerdict(None, measured, expected, f"ambiguous: {' or '.join(matches)} match")
    return ProbeVerdict(matches[0], measured, expected)
