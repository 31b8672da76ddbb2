"""The DPO kernel against docs/FORMULAS.md ("Preference optimization"): its value and its
gradient equal a plain per-pair reference written from the formula (float64, 1e-10), no
gradient reaches the reference log-probs, and the pure helpers (sequence sums, batches)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.dpo import (
    DPO_LOSSES,
    DpoSettings,
    dpo_loss,
    pair_batches,
    sequence_logprobs,
    steps_of_one_pass,
)

TOL = 1e-10


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return math.exp(_log_sigmoid(x))


def reference_loss(pw, pl, rw, rl, n_w, s: DpoSettings) -> float:
    """L = (1/P) Σ_p ℓ_p + α·(−Σ log π(y_w) / Σ n_w), one pair at a time, from the page."""
    total = 0.0
    for p in range(len(pw)):
        delta = (pw[p] - rw[p]) - (pl[p] - rl[p])
        h = s.beta * delta
        if s.loss == "sigmoid":
            eps = s.label_smoothing
            total += -(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)
        elif s.loss == "ipo":
            total += (delta - 1 / (2 * s.beta)) ** 2
        else:
            total += max(0.0, 1 - h)
    loss = total / len(pw)
    if s.sft_weight > 0:
        loss += s.sft_weight * (-sum(pw) / sum(n_w))
    return loss


def reference_gradient(pw, pl, rw, rl, n_w, s: DpoSettings) -> tuple[list[float], list[float]]:
    """∂L/∂log π(y_w,p) and ∂L/∂log π(y_l,p), from the gradients the page states."""
    grad_w, grad_l = [], []
    P = len(pw)
    for p in range(P):
        delta = (pw[p] - rw[p]) - (pl[p] - rl[p])
        h = s.beta * delta
        if s.loss == "sigmoid":
            eps = s.label_smoothing
            g = -s.beta * ((1 - eps) * _sigmoid(-h) - eps * _sigmoid(h))
        elif s.loss == "ipo":
            g = 2 * (delta - 1 / (2 * s.beta))
        else:
            g = -s.beta if h < 1 else 0.0
        sft = -s.sft_weight / sum(n_w) if s.sft_weight > 0 else 0.0
        grad_w.append(g / P + sft)
        grad_l.append(-g / P)
    return grad_w, grad_l


FINITE = st.floats(-30.0, 0.0, allow_nan=False)


@st.composite
def pair_batches_and_settings(draw: st.DrawFn) -> tuple[np.ndarray, DpoSettings]:
    """P pairs of (log π(y_w), log π(y_l), log π_ref(y_w), log π_ref(y_l), n_w), settings."""
    P = draw(st.integers(1, 8))
    values = np.array(draw(st.lists(st.tuples(*[FINITE] * 4), min_size=P, max_size=P)))
    n_w = np.array(draw(st.lists(st.integers(1, 40), min_size=P, max_size=P)), dtype=np.float64)
    loss = draw(st.sampled_from(DPO_LOSSES))
    settings = DpoSettings(
        beta=draw(st.floats(0.01, 5.0)),
        loss=loss,
        label_smoothing=draw(st.floats(0.0, 0.45)) if loss == "sigmoid" else 0.0,
        sft_weight=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
    )
    return np.column_stack([values, n_w]), settings


def _run(columns: np.ndarray, settings: DpoSettings):
    pw, pl, rw, rl, n_w = (torch.tensor(c, dtype=torch.float64) for c in columns.T)
    pw.requires_grad_(True)
    pl.requires_grad_(True)
    rw.requires_grad_(True)
    rl.requires_grad_(True)
    loss, metrics = dpo_loss(pw, pl, rw, rl, settings, chosen_tokens_P=n_w)
    loss.backward()
    return loss, metrics, (pw, pl, rw, rl)


@given(pair_batches_and_settings())
def test_dpo_loss_equals_the_per_pair_formula(case: tuple[np.ndarray, DpoSettings]) -> None:
    columns, settings = case
    loss, _, _ = _run(columns, settings)
    expected = reference_loss(*columns.T.tolist(), settings)
    assert abs(float(loss.detach()) - expected) <= TOL * max(1.0, abs(expected))


@given(pair_batches_and_settings())
def test_dpo_gradient_equals_the_formula_and_none_reaches_the_reference(
    case: tuple[np.ndarray, DpoSettings],
) -> None:
    columns, settings = case
    _, _, (pw, pl, rw, rl) = _run(columns, settings)
    grad_w, grad_l = reference_gradient(*columns.T.tolist(), settings)
    np.testing.assert_allclose(pw.grad.numpy(), grad_w, rtol=0, atol=TOL)
    np.testing.assert_allclose(pl.grad.numpy(), grad_l, rtol=0, atol=TOL)
    # The reference is a constant: sg(log π_ref), whatever the caller's tensors require.
    assert rw.grad is None and rl.grad is None


@given(pair_batches_and_settings())
def test_dpo_gradient_equals_autograd_through_the_plain_reference(
    case: tuple[np.ndarray, DpoSettings],
) -> None:
    """The same gradient as autograd through a per-pair loop over python scalars."""
    columns, settings = case
    _, _, (pw, pl, _, _) = _run(columns, settings)
    pw2 = torch.tensor(columns[:, 0], dtype=torch.float64, requires_grad=True)
    pl2 = torch.tensor(columns[:, 1], dtype=torch.float64, requires_grad=True)
    rw, rl, n_w = columns[:, 2], columns[:, 3], columns[:, 4]
    terms = []
    for p in range(len(rw)):
        delta = (pw2[p] - rw[p]) - (pl2[p] - rl[p])
        h = settings.beta * delta
        if settings.loss == "sigmoid":
            eps = settings.label_smoothing
            terms.append(
                -(1 - eps) * torch.log(torch.sigmoid(h)) - eps * torch.log(torch.sigmoid(-h))
            )
        elif settings.loss == "ipo":
            terms.append((delta - 1 / (2 * settings.beta)) ** 2)
        else:
            terms.append(torch.clamp(1 - h, min=0))
    loss = torch.stack(terms).mean()
    if settings.sft_weight > 0:
        loss = loss + settings.sft_weight * (-pw2.sum() / float(n_w.sum()))
    loss.backward()
    np.testing.assert_allclose(pw.grad.numpy(), pw2.grad.numpy(), rtol=0, atol=1e-9)
    np.testing.assert_allclose(pl.grad.numpy(), pl2.grad.numpy(), rtol=0, atol=1e-9)


@given(pair_batches_and_settings())
def test_dpo_metrics_are_the_implicit_rewards(case: tuple[np.ndarray, DpoSettings]) -> None:
    columns, settings = case
    _, metrics, _ = _run(columns, settings)
    pw, pl, rw, rl, _ = columns.T
    chosen, rejected = settings.beta * (pw - rw), settings.beta * (pl - rl)
    assert metrics["chosen_reward"] == pytest.approx(chosen.mean(), abs=TOL)
    assert metrics["rejected_reward"] == pytest.approx(rejected.mean(), abs=TOL)
    assert metrics["margin"] == pytest.approx((chosen - rejected).mean(), abs=TOL)
    assert metrics["accuracy"] == pytest.approx((chosen > rejected).mean(), abs=TOL)
    assert metrics["chosen_logprob"] == pytest.approx(pw.mean(), abs=TOL)
    assert metrics["rejected_logprob"] == pytest.approx(pl.mean(), abs=TOL)


def test_at_the_reference_the_sigmoid_loss_is_log_2_and_accuracy_0() -> None:
    lp = torch.tensor([-3.0, -7.5], dtype=torch.float64)
    loss, metrics = dpo_loss(lp, lp - 1, lp, lp - 1, DpoSettings(beta=0.5))
    assert float(loss) == pytest.approx(math.log(2), abs=TOL)
    assert metrics["accuracy"] == 0.0 and metrics["margin"] == 0.0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="beta must be"):
        DpoSettings(beta=0.0)
    with pytest.raises(ValueError, match="loss must be one of sigmoid, ipo, hinge"):
        DpoSettings(loss="kto")
    with pytest.raises(ValueError, match="label smoothing applies to the sigmoid loss only"):
        DpoSettings(loss="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        DpoSettings(label_smoothing=0.5)
    with pytest.raises(ValueError, match="needs chosen_tokens_P"):
        one = torch.zeros(1, dtype=torch.float64)
        dpo_loss(one, one, one, one, DpoSettings(sft_weight=1.0))


@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.data())
def test_sequence_logprobs_sum_the_masked_positions_of_each_sequence(
    lengths: list[int], data: st.DataObject
) -> None:
    n = sum(lengths)
    values = data.draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n))
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = sequence_logprobs(
        torch.tensor(values, dtype=torch.float64), torch.tensor(mask), lengths
    ).tolist()
    start, expected = 0, []
    for length in lengths:
        expected.append(sum(v for v, m in zip(values[start : start + length], mask[start:]) if m))
        start += length
    np.testing.assert_allclose(got, expected, atol=TOL)


@given(st.integers(1, 30), st.integers(1, 12), st.integers(1, 20), st.integers(0, 10**6))
def test_pair_batches_cover_every_pair_once_per_pass(
    pairs: int, batch_size: int, steps: int, seed: int
) -> None:
    batches = pair_batches(pairs, batch_size=batch_size, steps=steps, seed=seed)
    size = min(batch_size, pairs)
    assert len(batches) == steps and all(batch.size == size for batch in batches)
    order = np.concatenate(batches)
    for start in range(0, order.size - pairs + 1, pairs):  # each whole pass: a permutation
        assert sorted(order[start : start + pairs].tolist()) == list(range(pairs))
    assert steps_of_one_pass(pairs, batch_size) * size >= pairs
    again = pair_batches(pairs, batch_size=batch_size, steps=steps, seed=seed)
    assert all((a == b).all() for a, b in zip(batches, again))
