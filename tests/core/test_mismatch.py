"""Mismatch corrections and metrics against a float64 reference from docs/FORMULAS.md, and laws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core import losses
from grpo.core.alignment import pack_groups
from grpo.core.metrics import mismatch_metrics
from grpo.core.mismatch import (
    CORRECTED_LOSSES,
    MISMATCH_CORRECTIONS,
    MismatchCorrection,
    correct_batch,
    mismatch_weights,
)
from tests.strategies import PackedLossBatch, packed_loss_batches, scored_groups

MODES = [mode for mode in MISMATCH_CORRECTIONS if mode not in ("none", "recompute")]
REDUCTIONS = ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
PATHS = pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
pytestmark = pytest.mark.usefixtures("uncompiled_fused_forms")
CASES = [
    (mode, name)
    for mode in MODES
    for name in CORRECTED_LOSSES["sequence" if mode.startswith("sequence") else "token"]
]


@st.composite
def mismatch_batches(draw: st.DrawFn) -> tuple[PackedLossBatch, np.ndarray]:
    """A loss batch (lp, lp_s = its sampling log-probs, A, m) and lp_prox near lp."""
    batch = draw(packed_loss_batches())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 1e-3, 0.5, 2.0]))
    proximal = batch.logprobs - rng.uniform(-spread, spread, batch.logprobs.size)
    return batch, proximal


# --- the reference: Python floats, one token at a time ------------------------------------------


def _reference_weights(
    batch: PackedLossBatch, proximal: np.ndarray, correction: MismatchCorrection
) -> list[float]:
    """w_t of the table in docs/FORMULAS.md, 0 on masked-out positions."""
    weights = [0.0] * batch.logprobs.size
    for piece in batch.sequence_slices():
        tokens = [t for t in range(piece.start, piece.stop) if batch.mask[t]]
        if not tokens:
            continue
        log_ratios = {t: proximal[t] - batch.sampling_logprobs[t] for t in tokens}
        sequence_log_ratio = sum(log_ratios.values()) / len(tokens)
        for t in tokens:
            log_ratio = sequence_log_ratio if correction.level == "sequence" else log_ratios[t]
            ratio = math.exp(log_ratio)
            if correction.truncates:
                weights[t] = min(ratio, correction.cap)
            else:
                weights[t] = 1.0 if correction.low <= ratio <= correction.high else 0.0
    return weights


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _objective(name: str, logprob: float, proximal: float, advantage: float) -> tuple[float, float]:
    """(f, df/dlp) of a token kernel at its defaults, decoupled ratio r = exp(lp − lp_prox)."""
    ratio = math.exp(logprob - proximal)
    if name == "importance_sampling":
        return ratio * advantage, ratio * advantage
    low, high = (0.0, 4.0) if name == "cispo" else (0.8, 1.2)
    if name == "cispo":
        return _clip(ratio, low, high) * advantage * logprob, _clip(ratio, low, high) * advantage
    clipped = (advantage > 0 and ratio > high) or (advantage < 0 and ratio < low)
    return min(ratio * advantage, _clip(ratio, low, high) * advantage), (
        0.0 if clipped else ratio * advantage
    )


def _reference(
    name: str, batch: PackedLossBatch, proximal: np.ndarray, weights: list[float], reduction: str
) -> tuple[float, np.ndarray]:
    """(loss, gradient) of o_t = sg(w_t)·f(r_t, A_t), masked tokens kept in the denominators."""
    sequences = [
        [t for t in range(piece.start, piece.stop) if batch.mask[t]]
        for piece in batch.sequence_slices()
    ]
    trained = [tokens for tokens in sequences if tokens]
    num_tokens = sum(len(tokens) for tokens in sequences)
    loss, gradient = 0.0, np.zeros(batch.logprobs.size)
    if name == "gspo":
        scale = 1.0 if reduction == "sum" else 1 / max(len(trained), 1)
        for tokens in trained:
            ratio = math.exp(sum(batch.logprobs[t] - proximal[t] for t in tokens) / len(tokens))
            advantage = sum(batch.advantages[t] for t in tokens) / len(tokens)
            weight = weights[tokens[0]]
            low, high = 1 - 3e-4, 1 + 4e-4
            clipped = (advantage > 0 and ratio > high) or (advantage < 0 and ratio < low)
            loss -= scale * weight * min(ratio * advantage, _clip(ratio, low, high) * advantage)
            for t in tokens:
                slope = 0.0 if clipped else advantage * ratio
                gradient[t] = -scale * weight * slope / len(tokens)
        return loss, gradient
    for tokens in sequences:
        for t in tokens:
            scale = {
                "sum": 1.0,
                "token_mean": 1 / num_tokens,
                "seq_mean_token_mean": 1 / (len(trained) * len(tokens)),
                "seq_mean_token_sum": 1 / len(trained),
            }[reduction]
            value, slope = _objective(name, batch.logprobs[t], proximal[t], batch.advantages[t])
            loss -= scale * weights[t] * value
            gradient[t] = -scale * weights[t] * slope
    return loss, gradient


def _corrected(
    name: str,
    batch: PackedLossBatch,
    proximal: np.ndarray,
    correction: MismatchCorrection,
    reduction: str,
    fused: bool,
) -> tuple[float, np.ndarray, torch.Tensor]:
    """The production path: weights from mismatch_weights folded into A, lp_prox as lp_old."""
    logprobs, sampling, advantages, mask = batch.tensors(torch.float64)
    weights, _ = mismatch_weights(
        torch.from_numpy(proximal), sampling, mask, batch.seq_lens, correction
    )
    loss, _ = losses.LOSSES[name](
        logprobs,
        torch.where(mask, torch.from_numpy(proximal), 0.0),
        torch.where(mask, advantages * weights, 0.0),
        mask=mask,
        seq_lens=batch.seq_lens,
        reduction=reduction,
        fused=fused and losses.LOSSES[name].fused_form is not None,
    )
    loss.backward()
    assert logprobs.grad is not None
    return float(loss.detach()), logprobs.grad.numpy(), weights


def _close(actual: float, expected: float, scale: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9 * scale)


def _magnitude(batch: PackedLossBatch, proximal: np.ndarray, weights: list[float]) -> float:
    terms = np.where(
        batch.mask,
        np.exp(np.abs(batch.logprobs - proximal))
        * (np.abs(batch.advantages) + 1)
        * (np.abs(batch.logprobs) + 1)
        * (np.asarray(weights) + 1),
        1.0,
    )
    return float(terms.sum()) + 1.0


# --- the reference ---------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize(("mode", "name"), CASES)
@given(data=st.data())
def test_corrected_kernel_matches_the_float64_reference(
    mode: str, name: str, fused: bool, data: st.DataObject
) -> None:
    batch, proximal = data.draw(mismatch_batches())
    reduction = data.draw(st.sampled_from(REDUCTIONS))
    correction = MismatchCorrection(
        mode,
        cap=data.draw(st.sampled_from([1.0, 2.0, 10.0])),
        low=data.draw(st.sampled_from([0.0, 0.5, 0.99])),
        high=data.draw(st.sampled_from([1.01, 2.0, 1e9])),
    )
    expected_weights = _reference_weights(batch, proximal, correction)
    loss, gradient, weights = _corrected(name, batch, proximal, correction, reduction, fused)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=1e-12, atol=0)
    expected_loss, expected_gradient = _reference(
        name, batch, proximal, expected_weights, reduction
    )
    scale = _magnitude(batch, proximal, expected_weights)
    assert _close(loss, expected_loss, scale), (loss, expected_loss)
    np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-9, atol=1e-9 * scale)


# --- laws ------------------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize(("mode", "name"), [case for case in CASES if "truncate" in case[0]])
@given(data=st.data())
def test_an_unbounded_cap_without_mismatch_is_the_uncorrected_kernel(
    mode: str, name: str, fused: bool, data: st.DataObject
) -> None:
    batch, _ = data.draw(mismatch_batches())
    reduction = data.draw(st.sampled_from(REDUCTIONS))
    correction = MismatchCorrection(mode, cap=1e300)
    loss, gradient, _ = _corrected(
        name, batch, batch.sampling_logprobs.copy(), correction, reduction, fused
    )
    logprobs, sampling, advantages, mask = batch.tensors(torch.float64)
    plain, _ = losses.LOSSES[name](
        logprobs,
        sampling,
        advantages,
        mask=mask,
        seq_lens=batch.seq_lens,
        reduction=reduction,
        fused=fused and losses.LOSSES[name].fused_form is not None,
    )
    plain.backward()
    assert loss == float(plain.detach())
    np.testing.assert_array_equal(gradient, logprobs.grad.numpy())


@pytest.mark.parametrize("level", ["token", "sequence"])
@given(data=st.data())
def test_truncated_is_with_an_unbounded_cap_equals_plain_is_whatever_the_proximal(
    level: str, data: st.DataObject
) -> None:
    """For importance_sampling, ρ_t·exp(lp − lp_prox) = exp(lp − lp_s): C → ∞ changes nothing."""
    batch, proximal = data.draw(mismatch_batches())
    correction = MismatchCorrection(f"{level}_truncate", cap=1e300)
    loss, gradient, _ = _corrected(
        "importance_sampling", batch, proximal, correction, "sum", fused=False
    )
    if level == "token":
        logprobs, sampling, advantages, mask = batch.tensors(torch.float64)
        plain, _ = losses.importance_sampling(
            logprobs, sampling, advantages, mask=mask, seq_lens=batch.seq_lens
        )
        plain.backward()
        scale = _magnitude(batch, proximal, [1.0] * batch.logprobs.size) * math.exp(2)
        assert _close(loss, float(plain), scale)
        np.testing.assert_allclose(gradient, logprobs.grad.numpy(), rtol=1e-9, atol=1e-9 * scale)


@PATHS
@pytest.mark.parametrize(("mode", "name"), [case for case in CASES if "mask" in case[0]])
@given(data=st.data())
def test_masking_every_token_gives_zero_loss_and_zero_gradient(
    mode: str, name: str, fused: bool, data: st.DataObject
) -> None:
    batch, _ = data.draw(mismatch_batches())
    proximal = batch.sampling_logprobs + 0.5  # every ratio is e^0.5, outside [1, 1]
    correction = MismatchCorrection(mode, low=1.0, high=1.0)
    loss, gradient, _ = _corrected(
        name, batch, proximal, correction, data.draw(st.sampled_from(REDUCTIONS)), fused
    )
    assert loss == 0.0
    assert not gradient.any()


def test_the_weight_carries_no_gradient() -> None:
    """lp_prox = sg(lp) on the first minibatch: even given lp itself, w is a constant."""
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([True, True, True])
    for mode in MODES:
        weights, _ = mismatch_weights(logprobs, sampling, mask, [3], MismatchCorrection(mode))
        assert not weights.requires_grad, mode
        assert weights.grad_fn is None, mode


def test_fractions_count_truncated_and_masked_tokens() -> None:
    proximal = torch.tensor([0.0, math.log(3.0), math.log(0.25), 5.0], dtype=torch.float64)
    sampling = torch.zeros(4, dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    _, truncated = mismatch_weights(
        proximal, sampling, mask, [4], MismatchCorrection("token_truncate")
    )
    assert truncated["frac_truncated"] == pytest.approx(1 / 3)
    _, masked = mismatch_weights(proximal, sampling, mask, [4], MismatchCorrection("token_mask"))
    assert masked["frac_masked"] == pytest.approx(2 / 3)
    assert masked["weight_mean"] == pytest.approx(1 / 3)
    # Sequence level: the masked-out position shares ρ_i but is not counted.
    proximal = torch.tensor([math.log(3.0)] * 3 + [0.0], dtype=torch.float64)
    weights, whole = mismatch_weights(
        proximal, sampling, mask, [4], MismatchCorrection("sequence_truncate")
    )
    assert whole["frac_truncated"] == 1.0
    assert weights.tolist() == [2.0, 2.0, 2.0, 0.0]


@given(group=scored_groups(), seed=st.integers(0, 2**32 - 1))
def test_correct_batch_swaps_the_proximal_in_and_weights_the_advantages(group, seed: int) -> None:
    batch = pack_groups([group], drop_degenerate=False)
    rng = np.random.default_rng(seed)
    proximal = np.asarray(batch.sampling_logprobs) + rng.uniform(-1.0, 1.0, batch.num_tokens)
    corrected, _ = correct_batch(batch, proximal, MismatchCorrection("token_mask"))
    mask = np.asarray(batch.mask, dtype=bool)
    ratio = np.exp(proximal - np.asarray(batch.sampling_logprobs))
    kept = (ratio >= 0.5) & (ratio <= 2.0)
    np.testing.assert_array_equal(corrected.mask, batch.mask)
    np.testing.assert_array_equal(corrected.sampling_logprobs, np.where(mask, proximal, 0.0))
    np.testing.assert_array_equal(
        corrected.advantages, np.where(mask & kept, batch.advantages, 0.0)
    )


@given(data=st.data())
def test_recompute_trains_the_kernel_on_the_proximal_log_probs_unweighted(
    data: st.DataObject,
) -> None:
    batch, proximal = data.draw(mismatch_batches())
    name = data.draw(st.sampled_from(["importance_sampling", "ppo", "cispo", "dro", "gspo"]))
    MismatchCorrection("recompute").check_loss(name)
    loss, gradient, weights = _corrected(
        name, batch, proximal, MismatchCorrection("recompute"), "sum", fused=False
    )
    assert weights.tolist() == np.where(batch.mask, 1.0, 0.0).tolist()
    logprobs, _, advantages, mask = batch.tensors(torch.float64)
    plain, _ = losses.LOSSES[name](
        logprobs,
        torch.where(mask, torch.from_numpy(proximal), 0.0),
        advantages,
        mask=mask,
        seq_lens=batch.seq_lens,
    )
    plain.backward()
    assert loss == float(plain.detach())
    np.testing.assert_array_equal(gradient, logprobs.grad.numpy())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "tis"}, "not one of"),
        ({"mode": "token_truncate", "cap": 0.5}, "cap"),
        ({"mode": "token_mask", "low": 1.2}, "low <= 1 <= high"),
        ({"mode": "token_mask", "high": 0.9}, "low <= 1 <= high"),
    ],
)
def test_bad_corrections_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MismatchCorrection(**kwargs)


@pytest.mark.parametrize(
    ("mode", "loss"),
    [("token_truncate", "dro"), ("token_mask", "gspo"), ("sequence_mask", "cross_entropy")],
)
def test_corrections_refuse_kernels_not_linear_in_the_advantage(mode: str, loss: str) -> None:
    with pytest.raises(ValueError, match="linear in the advantage"):
        MismatchCorrection(mode).check_loss(loss)


# --- mismatch_metrics ----------------------------------------------------------------------------


@given(batch=packed_loss_batches())
def test_mismatch_metrics_match_the_formulas(batch: PackedLossBatch) -> None:
    trainer = batch.logprobs
    sampler = np.clip(batch.sampling_logprobs, trainer - 3.0, trainer + 3.0)
    found = mismatch_metrics(trainer, sampler, batch.mask, batch.seq_lens)
    deltas = [sampler[t] - trainer[t] for t in range(trainer.size) if batch.mask[t]]
    if not deltas:
        assert found["kl_k3"] == 0.0 and found["seq_ratio_min"] == 1.0
        return
    assert found["kl_k1"] == pytest.approx(sum(deltas) / len(deltas), abs=1e-12)
    k3 = [math.exp(-d) + d - 1 for d in deltas]
    assert found["kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-9, abs=1e-12)
    assert found["kl_k3"] >= 0
    assert found["max_abs_log_ratio"] == pytest.approx(max(abs(d) for d in deltas))
    off = [abs(d) > math.log(2) for d in deltas]
    assert found["frac_off_by_2x"] == pytest.approx(sum(off) / len(off))
    ratios = []
    for piece in batch.sequence_slices():
        tokens = [t for t in range(piece.start, piece.stop) if batch.mask[t]]
        if tokens:
            ratios.append(math.exp(sum(trainer[t] - sampler[t] for t in tokens) / len(tokens)))
    assert found["seq_ratio_std"] == pytest.approx(float(np.std(ratios)), abs=1e-12)
    assert found["seq_ratio_min"] == pytest.approx(min(ratios))
    assert found["seq_ratio_max"] == pytest.approx(max(ratios))


@given(batch=packed_loss_batches())
def test_no_mismatch_measures_zero(batch: PackedLossBatch) -> None:
    found = mismatch_metrics(batch.logprobs, batch.logprobs, batch.mask, batch.seq_lens)
    assert found["kl_k1"] == found["kl_k3"] == found["max_abs_log_ratio"] == 0.0
    assert found["frac_off_by_2x"] == 0.0 and found["seq_ratio_std"] == 0.0
    assert found["seq_ratio_min"] == found["seq_ratio_max"] == 1.0


def test_mismatch_metrics_refuse_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="log-prob pairs"):
        mismatch_metrics(np.zeros(3), np.zeros(3), np.ones(4, dtype=bool), [4])
