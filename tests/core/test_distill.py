"""On-policy distillation's maths against plain reference implementations (docs/FORMULAS.md,
"On-policy distillation")."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.distill import (
    discounted_suffix_sums,
    distill_advantages,
    distill_metrics,
    teacher_logprobs_at,
)
from tests.strategies import distill_batches


def reference_suffix_sums(values, seq_lens, discount):
    """x_t = Σ_{k ≥ t in t's sequence} γ^(k−t) v_k, one token at a time from each end."""
    out, start = np.zeros(len(values)), 0
    for length in seq_lens:
        running = 0.0
        for t in reversed(range(start, start + length)):
            running = values[t] + discount * running
            out[t] = running
        start += length
    return out


def reference_advantages(batch, coef, discount, weight, clip):
    """A_t = w·Â_t − Σ_{k≥t} γ^(k−t) clamp(c·(s_k − q_k)) on the mask, by the definition."""
    out, start = np.zeros(len(batch["mask"])), 0
    for length in batch["seq_lens"]:
        for t in range(start, start + length):
            if not batch["mask"][t]:
                continue
            total = 0.0
            for k in range(t, start + length):
                if batch["mask"][k]:
                    p = coef * (batch["student"][k] - batch["teacher"][k])
                    if clip > 0:
                        p = min(max(p, -clip), clip)
                    total += discount ** (k - t) * p
            out[t] = weight * batch["task"][t] - total
        start += length
    return out


@given(distill_batches(), st.floats(0.0, 1.0))
def test_discounted_suffix_sums_equal_the_reference_recursion(batch, discount):
    values = batch["student"] - batch["teacher"]
    np.testing.assert_allclose(
        discounted_suffix_sums(values, batch["seq_lens"], discount),
        reference_suffix_sums(values, batch["seq_lens"], discount),
        atol=1e-9,
    )


@given(distill_batches())
def test_discount_zero_is_the_token_value_and_one_the_reverse_cumsum(batch):
    values, lens = batch["student"] - batch["teacher"], batch["seq_lens"]
    np.testing.assert_array_equal(discounted_suffix_sums(values, lens, 0.0), values)
    cuts = np.cumsum(lens)[:-1]
    expected = np.concatenate([np.cumsum(part[::-1])[::-1] for part in np.split(values, cuts)])
    np.testing.assert_allclose(discounted_suffix_sums(values, lens, 1.0), expected, atol=1e-9)


@given(
    distill_batches(),
    st.floats(0.0, 3.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 2.0),
    st.sampled_from([0.0, 0.5, 2.0]),
)
def test_distill_advantages_equal_the_definition(batch, coef, discount, weight, clip):
    terms = distill_advantages(
        batch["task"],
        batch["student"],
        batch["teacher"],
        batch["mask"],
        batch["seq_lens"],
        coef=coef,
        discount=discount,
        task_weight=weight,
        clip=clip,
    )
    np.testing.assert_allclose(
        terms.advantages_N, reference_advantages(batch, coef, discount, weight, clip), atol=1e-9
    )
    assert (terms.advantages_N[batch["mask"] == 0] == 0).all()


@given(distill_batches(), st.sampled_from([0.1, 0.5, 1.0]))
def test_clamp_bounds_every_token_penalty(batch, clip):
    terms = distill_advantages(
        np.zeros_like(batch["mask"]),
        batch["student"],
        batch["teacher"],
        batch["mask"],
        batch["seq_lens"],
        coef=1.0,
        discount=0.0,
        task_weight=0.0,
        clip=clip,
    )
    assert (np.abs(terms.advantages_N) <= clip + 1e-12).all()
    raw = np.abs(batch["student"] - batch["teacher"]) > clip
    np.testing.assert_array_equal(terms.clipped_N, raw & (batch["mask"] > 0))


@given(distill_batches())
def test_a_token_the_teacher_prefers_gets_a_positive_advantage(batch):
    terms = distill_advantages(
        np.zeros_like(batch["mask"]),
        batch["student"],
        batch["teacher"],
        batch["mask"],
        batch["seq_lens"],
        coef=1.0,
        discount=0.0,
        task_weight=0.0,
    )
    on = batch["mask"] > 0
    prefers = on & (batch["teacher"] > batch["student"])
    assert (terms.advantages_N[prefers] > 0).all()
    assert (terms.advantages_N[on & (batch["teacher"] < batch["student"])] < 0).all()


@given(distill_batches(), st.floats(0.0, 1.0), st.floats(0.0, 2.0))
def test_identical_teacher_leaves_the_task_advantage_and_zero_kl(batch, discount, weight):
    terms = distill_advantages(
        batch["task"],
        batch["student"],
        batch["student"],
        batch["mask"],
        batch["seq_lens"],
        coef=1.0,
        discount=discount,
        task_weight=weight,
    )
    np.testing.assert_allclose(terms.advantages_N, weight * batch["task"] * batch["mask"])
    metrics = distill_metrics(batch["student"], batch["student"], batch["mask"])
    assert metrics["distill/reverse_kl"] == 0.0
    assert metrics["distill/reverse_kl_k3"] == 0.0


@given(distill_batches())
def test_metrics_are_the_means_over_completion_tokens(batch):
    on = batch["mask"] > 0
    delta = batch["student"][on] - batch["teacher"][on]
    metrics = distill_metrics(batch["student"], batch["teacher"], batch["mask"])
    assert metrics["distill/reverse_kl"] == pytest.approx(delta.mean())
    assert metrics["distill/reverse_kl_k3"] == pytest.approx((np.exp(-delta) + delta - 1).mean())
    assert metrics["distill/reverse_kl_k3"] >= 0
    assert metrics["distill/student_logprob"] == pytest.approx(batch["student"][on].mean())
    assert metrics["distill/teacher_logprob"] == pytest.approx(batch["teacher"][on].mean())


def test_teacher_logprobs_are_the_entries_at_the_sampled_positions():
    # prompt [a, b] + completion [c, d, e]: entry k scores token k given tokens before it
    entries = [None, -0.1, -1.0, -2.0, -3.0]
    np.testing.assert_array_equal(teacher_logprobs_at(entries, [2, 3, 4]), [-1.0, -2.0, -3.0])
    # an episode: action [c], observation [d], action [e]: the observation is not scored
    np.testing.assert_array_equal(teacher_logprobs_at(entries, [2, 4]), [-1.0, -3.0])
    with pytest.raises(ValueError, match="sampled positions run 0..1"):
        teacher_logprobs_at([None, -1.0], [0, 1])
    with pytest.raises(ValueError, match="whole stream"):
        teacher_logprobs_at([None, -1.0], [1, 2])


def test_bad_shapes_and_values_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        distill_advantages(
            np.zeros(3), np.zeros(3), np.zeros(2), np.ones(3), [3],
            coef=1.0, discount=0.0, task_weight=0.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="discount"):
        discounted_suffix_sums(np.zeros(2), [2], 1.5)
    with pytest.raises(ValueError, match="seq_lens"):
        discounted_suffix_sums(np.zeros(2), [3], 0.5)
