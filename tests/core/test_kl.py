"""KL estimators (grpo.core.kl) against their formulas (docs/FORMULAS.md, KL)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core import kl


@given(
    deltas=st.lists(st.floats(-20.0, 20.0), min_size=1, max_size=20),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
)
def test_kl_estimators_match_their_formulas(deltas: list[float], estimator: str) -> None:
    ref_logprobs = torch.zeros(len(deltas), dtype=torch.float64)
    logprobs = torch.tensor(deltas, dtype=torch.float64)
    formula = {
        "k1": lambda delta: delta,
        "k2": lambda delta: delta**2 / 2,
        "k3": lambda delta: math.exp(-delta) + delta - 1,
    }[estimator]
    expected = [formula(delta) for delta in deltas]
    actual = kl.kl_penalty(logprobs, ref_logprobs, estimator=estimator)
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-9, atol=1e-15)
    assert kl.KL_ESTIMATORS[estimator] is not None


@given(
    logprobs=st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=20),
    ref_logprobs=st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=20),
)
def test_k3_is_nonnegative_and_zero_at_equal_logprobs(
    logprobs: list[float], ref_logprobs: list[float]
) -> None:
    size = min(len(logprobs), len(ref_logprobs))
    current = torch.tensor(logprobs[:size], dtype=torch.float64)
    reference = torch.tensor(ref_logprobs[:size], dtype=torch.float64)
    assert torch.all(kl.kl_penalty(current, reference) >= 0)
    assert torch.all(kl.kl_penalty(current, current) == 0)


def test_unknown_kl_estimator_raises_listing_the_estimators() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of k1, k2, k3"):
        kl.kl_penalty(torch.zeros(2), torch.zeros(2), estimator="k4")
