"""Loss kernels against a per-token reference written from docs/FORMULAS.md, and their laws."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from grpo.core import losses
from tests.strategies import (
    LOSS_CONFIGS,
    PackedLossBatch,
    masked_perturbations,
    packed_loss_batches,
)

KERNELS = sorted(losses.LOSSES)
POLICY_KERNELS = [name for name in KERNELS if name != "cross_entropy"]
NORM_LENGTH = 7.0
# Each law holds on both paths: the eager kernel and the single-pass fused form. Here the
# fused form runs uncompiled (the same math, fast to call on hypothesis' many shapes);
# tests/core/test_fused_losses.py checks the compiled form against the eager kernel.
PATHS = pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])


@pytest.fixture(autouse=True, scope="module")
def _fused_forms_run_uncompiled() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(losses, "_compiled_form", lambda form: form)
        yield


def _norm_length(reduction: str) -> float | None:
    return NORM_LENGTH if reduction == "seq_mean_token_sum_norm" else None


# --- the reference: one token at a time, Python floats, docs/FORMULAS.md verbatim ------------


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _clipped_surrogate(
    ratio: float, advantage: float, low: float, high: float, dual_clip: float | None
) -> tuple[float, float]:
    """(o, do/dr) of min(r·A, clip(r, lo, hi)·A), dual-clipped at c·A for A < 0."""
    objective = min(ratio * advantage, _clip(ratio, low, high) * advantage)
    clipped_side = (advantage > 0 and ratio > high) or (advantage < 0 and ratio < low)
    slope = 0.0 if clipped_side else advantage
    if dual_clip is not None and advantage < 0 and dual_clip * advantage > objective:
        objective, slope = dual_clip * advantage, 0.0
    return objective, slope


def _token_objective(
    name: str, config: dict, logprob: float, sampling_logprob: float, advantage: float
) -> tuple[float, float]:
    """(o_t, do_t/dlp_t) for one masked-in token."""
    log_ratio = logprob - sampling_logprob
    if name == "cross_entropy":
        return advantage * logprob, advantage
    if name == "dro":
        beta = config["beta"]
        return logprob * advantage - beta / 2 * log_ratio**2, advantage - beta * log_ratio
    ratio = math.exp(log_ratio)
    if name == "importance_sampling":
        return ratio * advantage, ratio * advantage
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if name == "cispo":
        weight = _clip(ratio, low, high) * advantage
        return weight * logprob, weight
    assert name == "ppo"
    objective, slope = _clipped_surrogate(ratio, advantage, low, high, config["dual_clip"])
    return objective, slope * ratio


def _reference(
    name: str,
    config: dict,
    batch: PackedLossBatch,
    reduction: str,
    norm_length: float | None = None,
) -> tuple[float, np.ndarray, dict[str, float]]:
    """(loss, d loss/d lp, metrics) straight from docs/FORMULAS.md, token by token."""
    config = losses.resolve_config(name, config)
    gradient = np.zeros(batch.logprobs.size)
    sequences = [
        [t for t in range(piece.start, piece.stop) if batch.mask[t]]
        for piece in batch.sequence_slices()
    ]
    trained_sequences = [tokens for tokens in sequences if tokens]
    num_sequences = len(trained_sequences)
    num_tokens = sum(len(tokens) for tokens in sequences)
    ratios, advantages = [], []
    loss = 0.0
    if name == "gspo":
        # Every sequence is one unit carrying ℓ_i; token sum -> ℓ_i and n_i -> 1.
        weight = {
            "sum": 1.0,
            "token_mean": 1 / max(num_sequences, 1),
            "seq_mean_token_mean": 1 / max(num_sequences, 1),
            "seq_mean_token_sum": 1 / max(num_sequences, 1),
            "seq_mean_token_sum_norm": 1 / max(num_sequences, 1) / (norm_length or 1),
        }[reduction]
        for tokens in trained_sequences:
            mean_log_ratio = sum(
                batch.logprobs[t] - batch.sampling_logprobs[t] for t in tokens
            ) / len(tokens)
            sequence_ratio = math.exp(mean_log_ratio)
            advantage = sum(batch.advantages[t] for t in tokens) / len(tokens)
            objective, slope = _clipped_surrogate(
                sequence_ratio,
                advantage,
                config["clip_low_threshold"],
                config["clip_high_threshold"],
                None,
            )
            loss -= weight * objective
            for t in tokens:
                gradient[t] = -weight * slope * sequence_ratio / len(tokens)
            ratios.append(sequence_ratio)
            advantages.append(advantage)
    else:
        for tokens in sequences:
            for t in tokens:
                weight = {
                    "sum": 1.0,
                    "token_mean": 1 / num_tokens,
                    "seq_mean_token_mean": 1 / (num_sequences * len(tokens)),
                    "seq_mean_token_sum": 1 / num_sequences,
                    "seq_mean_token_sum_norm": 1 / (num_sequences * (norm_length or 1)),
                }[reduction]
                objective, slope = _token_objective(
                    name,
                    config,
                    batch.logprobs[t],
                    batch.sampling_logprobs[t],
                    batch.advantages[t],
                )
                loss -= weight * objective
                gradient[t] = -weight * slope
                ratios.append(math.exp(batch.logprobs[t] - batch.sampling_logprobs[t]))
                advantages.append(batch.advantages[t])
    return loss, gradient, _reference_metrics(name, config, loss, num_tokens, ratios, advantages)


def _reference_metrics(
    name: str, config: dict, loss: float, num_tokens: int, ratios: list, advantages: list
) -> dict[str, float]:
    metrics = {"loss": loss, "train_tokens": float(num_tokens)}
    count = max(len(ratios), 1)
    metrics["ratio_mean"] = sum(ratios) / count
    metrics["ratio_min"] = min(ratios, default=0.0)
    metrics["ratio_max"] = max(ratios, default=0.0)
    low = config.get("clip_low_threshold", 0.0)
    high = config.get("clip_high_threshold", math.inf)
    dual_clip = config.get("dual_clip")
    below = [r < low for r in ratios]
    above = [r > high for r in ratios]
    if name in ("ppo", "gspo"):
        clipped = [
            (a > 0 and r > high)
            or (a < 0 and (r < low or (dual_clip is not None and r > dual_clip)))
            for r, a in zip(ratios, advantages, strict=True)
        ]
    elif name == "cispo":
        clipped = [b or h for b, h in zip(below, above, strict=True)]
        metrics["clipped_ratio_mean"] = sum(_clip(r, low, high) for r in ratios) / count
    else:
        clipped = below = above = []
    metrics["clip_fraction"] = sum(clipped) / count
    metrics["clip_low_fraction"] = sum(below) / count
    metrics["clip_high_fraction"] = sum(above) / count
    return metrics


def _run(
    name: str,
    batch: PackedLossBatch,
    reduction: str = "sum",
    dtype: torch.dtype = torch.float64,
    *,
    fused: bool = False,
    scale: float = 1.0,
    **config: float | None,
) -> tuple[torch.Tensor, np.ndarray, dict[str, float]]:
    """(loss, d(scale·loss)/d lp as numpy, metrics) of the kernel on batch (eager or fused)."""
    logprobs, sampling_logprobs, advantages, mask = batch.tensors(dtype)
    loss, metrics = losses.LOSSES[name](
        logprobs,
        sampling_logprobs,
        advantages,
        mask=mask,
        seq_lens=batch.seq_lens,
        reduction=reduction,
        norm_length=_norm_length(reduction),
        fused=fused and losses.LOSSES[name].fused_form is not None,
        **config,
    )
    (loss if scale == 1.0 else scale * loss).backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad.numpy(), metrics


def _scale(batch: PackedLossBatch) -> float:
    """Size of the largest per-token term: float64 sums are exact to ~1e-16 of it."""
    log_ratios = np.where(batch.mask, batch.logprobs - batch.sampling_logprobs, 0.0)
    trained = np.where(batch.mask, np.abs(batch.advantages) + 1, 1.0)
    return float(np.max(np.exp(np.abs(log_ratios)) * trained * 40, initial=1.0))


def _assert_metrics_close(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(
            actual[key], value, rel_tol=1e-9, abs_tol=1e-9 * max(1.0, abs(value))
        ), (
            key,
            actual[key],
            value,
        )


@PATHS
@pytest.mark.parametrize("name", KERNELS)
@given(data=st.data())
def test_kernel_matches_per_token_reference_loss_gradient_and_metrics(
    name: str, fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    config = data.draw(LOSS_CONFIGS[name], label="config")
    tolerance = 1e-12 * _scale(batch)
    for reduction in losses.REDUCTIONS:
        loss, gradient, metrics = _run(name, batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = _reference(
            name, config, batch, reduction, _norm_length(reduction)
        )
        assert loss.dtype == torch.float64
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=tolerance), reduction
        np.testing.assert_allclose(
            gradient, expected_gradient, rtol=1e-9, atol=1e-12, err_msg=reduction
        )
        expected_metrics["loss"] = loss.item()
        _assert_metrics_close(metrics, expected_metrics)


@PATHS
@pytest.mark.parametrize("bounds", [(0.3, 0.6), (1.5, 2.5)], ids=["below-1", "above-1"])
@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_clip_counts_skip_masked_positions_when_both_bounds_exclude_ratio_one(
    name: str, bounds: tuple[float, float], fused: bool
) -> None:
    """Masked positions hold r = 1; with both bounds on one side of 1 they must not count."""
    batch = PackedLossBatch(
        logprobs=np.array([-1.0, -2.0, -0.5, -0.3, -0.7, -1.2, -0.9]),
        sampling_logprobs=np.array([-1.1, -1.5, -0.5, -0.2, -2.0, -0.2, -0.4]),
        advantages=np.array([1.0, -1.0, 0.5, 2.0, -0.5, 0.0, 1.5]),
        mask=np.array([True, True, False, True, False, True, True]),
        seq_lens=(3, 1, 3),
    )
    config = {"clip_low_threshold": bounds[0], "clip_high_threshold": bounds[1]}
    for reduction in losses.REDUCTIONS:
        loss, gradient, metrics = _run(name, batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = _reference(
            name, config, batch, reduction, _norm_length(reduction)
        )
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=1e-12), reduction
        np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-9, atol=1e-12)
        _assert_metrics_close(metrics, expected_metrics | {"loss": loss.item()})


@given(batch=packed_loss_batches())
def test_cross_entropy_without_sampling_logprobs_reports_only_loss_and_tokens(
    batch: PackedLossBatch,
) -> None:
    logprobs, _, weights, mask = batch.tensors()
    loss, metrics = losses.cross_entropy(logprobs, None, weights, mask=mask)
    expected_loss, _, _ = _reference("cross_entropy", {}, batch, "sum")
    assert math.isclose(loss.item(), expected_loss, rel_tol=1e-12, abs_tol=1e-12 * _scale(batch))
    assert metrics == {"loss": loss.item(), "train_tokens": float(batch.mask.sum())}


# --- laws -----------------------------------------------------------------------------


@PATHS
@given(batch=packed_loss_batches(), reduction=st.sampled_from(losses.REDUCTIONS))
def test_importance_sampling_equals_ppo_with_bounds_zero_and_infinity(
    fused: bool, batch: PackedLossBatch, reduction: str
) -> None:
    is_loss, is_gradient, is_metrics = _run("importance_sampling", batch, reduction, fused=fused)
    ppo_loss, ppo_gradient, ppo_metrics = _run(
        "ppo", batch, reduction, clip_low_threshold=0.0, clip_high_threshold=math.inf, fused=fused
    )
    assert torch.equal(is_loss, ppo_loss)
    np.testing.assert_array_equal(is_gradient, ppo_gradient)
    assert is_metrics == ppo_metrics


@PATHS
@given(batch=packed_loss_batches(), config=LOSS_CONFIGS["cispo"])
def test_cispo_gradient_equals_negative_clipped_ratio_times_advantage(
    fused: bool, batch: PackedLossBatch, config: dict
) -> None:
    resolved = losses.resolve_config("cispo", config)
    ratio = np.exp(np.where(batch.mask, batch.logprobs - batch.sampling_logprobs, 0.0))
    clipped_ratio = np.clip(ratio, resolved["clip_low_threshold"], resolved["clip_high_threshold"])
    _, gradient, _ = _run("cispo", batch, **config, fused=fused)
    expected = np.where(batch.mask, -clipped_ratio * batch.advantages, 0.0)
    np.testing.assert_allclose(gradient, expected, rtol=1e-12, atol=0)


@PATHS
@given(batch=packed_loss_batches(), config=LOSS_CONFIGS["cispo"])
def test_cispo_gradient_does_not_depend_on_whether_ratio_is_clipped(
    fused: bool, batch: PackedLossBatch, config: dict
) -> None:
    """Moving every clipped ratio onto its bound changes neither the loss nor the gradient."""
    resolved = losses.resolve_config("cispo", config)
    log_ratio = batch.logprobs - batch.sampling_logprobs
    with np.errstate(divide="ignore"):  # log(0) = -inf: a lower bound of 0 clips nothing
        bounds = np.log([resolved["clip_low_threshold"], resolved["clip_high_threshold"]])
    clipped_log_ratio = np.where(batch.mask, np.clip(log_ratio, *bounds), log_ratio)
    on_bounds = attrs.evolve(batch, sampling_logprobs=batch.logprobs - clipped_log_ratio)
    loss, gradient, _ = _run("cispo", batch, **config, fused=fused)
    bound_loss, bound_gradient, _ = _run("cispo", on_bounds, **config, fused=fused)
    tolerance = 1e-12 * _scale(batch)
    assert math.isclose(loss.item(), bound_loss.item(), rel_tol=1e-9, abs_tol=tolerance)
    np.testing.assert_allclose(gradient, bound_gradient, rtol=1e-9, atol=tolerance)
    is_clipped = batch.mask & (np.abs(log_ratio - clipped_log_ratio) > 0) & (batch.advantages != 0)
    assert np.all(gradient[is_clipped] != 0)


@PATHS
@given(batch=packed_loss_batches(), config=LOSS_CONFIGS["ppo"])
def test_ppo_gradient_vanishes_exactly_on_the_clipped_side(
    fused: bool, batch: PackedLossBatch, config: dict
) -> None:
    resolved = losses.resolve_config("ppo", config | {"dual_clip": None})
    low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
    ratio = np.exp(np.where(batch.mask, batch.logprobs - batch.sampling_logprobs, 0.0))
    advantages = batch.advantages
    clipped_side = batch.mask & (
        ((advantages > 0) & (ratio > high)) | ((advantages < 0) & (ratio < low))
    )
    _, gradient, metrics = _run("ppo", batch, **resolved, fused=fused)
    assert np.all(gradient[clipped_side] == 0.0)
    unclipped = batch.mask & ~clipped_side
    np.testing.assert_allclose(gradient[unclipped], -(ratio * advantages)[unclipped], rtol=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(clipped_side.sum() / max(batch.mask.sum(), 1))


@PATHS
@given(
    batch=packed_loss_batches(),
    config=LOSS_CONFIGS["ppo"],
    dual_clip=st.floats(1.5, 10.0),
)
def test_ppo_dual_clip_caps_negative_advantage_loss_at_c_times_advantage(
    fused: bool, batch: PackedLossBatch, config: dict, dual_clip: float
) -> None:
    """Where A < 0 and max(r, lo) > c the token's objective is c·A with zero gradient;
    everywhere else dual clip changes nothing."""
    plain = losses.resolve_config("ppo", config | {"dual_clip": None})
    low = plain["clip_low_threshold"]
    ratio = np.exp(np.where(batch.mask, batch.logprobs - batch.sampling_logprobs, 0.0))
    advantages = batch.advantages
    dual_active = batch.mask & (advantages < 0) & (np.maximum(ratio, low) > dual_clip)
    plain_loss, plain_gradient, _ = _run("ppo", batch, **plain, fused=fused)
    dual_loss, dual_gradient, _ = _run(
        "ppo", batch, **(plain | {"dual_clip": dual_clip}), fused=fused
    )
    assert np.all(dual_gradient[dual_active] == 0.0)
    np.testing.assert_array_equal(dual_gradient[~dual_active], plain_gradient[~dual_active])
    # The loss is −Σ o, so replacing max(r, lo)·A by c·A on active tokens shifts it by:
    shift = -np.sum(((dual_clip - np.maximum(ratio, low)) * advantages)[dual_active])
    assert math.isclose(
        (dual_loss - plain_loss).item(), shift, rel_tol=1e-9, abs_tol=1e-12 * _scale(batch)
    )


@st.composite
def _batches_with_an_active_dual_clip(draw: st.DrawFn) -> tuple[PackedLossBatch, float]:
    """(negative-advantage batch, dual clip c) with at least one trained token at r > c."""
    batch = draw(packed_loss_batches(advantages=st.floats(-3.0, -0.1)), label="batch")
    assume(batch.logprobs.size > 0)
    dual_clip = draw(st.floats(1.5, 10.0), label="dual_clip")
    position = draw(st.integers(0, batch.logprobs.size - 1), label="position")
    mask, advantages = batch.mask.copy(), batch.advantages.copy()
    log_ratios = batch.logprobs - batch.sampling_logprobs
    mask[position] = True
    advantages[position] = draw(st.floats(-3.0, -0.1), label="advantage")
    log_ratios[position] = math.log(dual_clip) + draw(st.floats(1e-3, 20.0), label="excess")
    active = attrs.evolve(
        batch,
        sampling_logprobs=batch.logprobs - log_ratios,
        advantages=advantages,
        mask=mask,
    )
    return active, dual_clip


@PATHS
@given(data=_batches_with_an_active_dual_clip(), config=LOSS_CONFIGS["ppo"])
def test_ppo_matches_reference_where_the_dual_clip_is_active(
    fused: bool, data: tuple[PackedLossBatch, float], config: dict
) -> None:
    """Every batch holds a dual-clipped token, whose gradient and clip share the main
    reference test reaches only by chance (it needs A < 0, r > c and a dual clip drawn)."""
    batch, dual_clip = data
    config = config | {"dual_clip": dual_clip}
    tolerance = 1e-12 * _scale(batch)
    for reduction in losses.REDUCTIONS:
        loss, gradient, metrics = _run("ppo", batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = _reference(
            "ppo", config, batch, reduction, _norm_length(reduction)
        )
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=tolerance), reduction
        np.testing.assert_allclose(
            gradient, expected_gradient, rtol=1e-9, atol=1e-12, err_msg=reduction
        )
        _assert_metrics_close(metrics, expected_metrics | {"loss": loss.item()})


@PATHS
@pytest.mark.parametrize("name", KERNELS)
@given(
    data=st.data(),
    reduction=st.sampled_from(losses.REDUCTIONS),
    scale=st.one_of(
        st.sampled_from([0.0, -1.0]), st.floats(0.125, 8.0).filter(lambda scale: scale != 1.0)
    ),
)
def test_backward_of_a_scaled_loss_gives_the_scaled_gradient(
    name: str, fused: bool, data: st.DataObject, reduction: str, scale: float
) -> None:
    """d(c·loss)/d lp = c·d loss/d lp (e.g. loss / num_microbatches before backward):
    the precomputed gradient must be multiplied by the gradient flowing into the loss."""
    batch = data.draw(packed_loss_batches(), label="batch")
    config = data.draw(LOSS_CONFIGS[name], label="config")
    _, gradient, _ = _run(name, batch, reduction, **config, fused=fused, scale=scale)
    _, expected_gradient, _ = _reference(name, config, batch, reduction, _norm_length(reduction))
    np.testing.assert_allclose(
        gradient, scale * expected_gradient, rtol=1e-9, atol=1e-12 * abs(scale)
    )


@PATHS
@given(data=st.data())
def test_policy_losses_are_zero_with_zero_advantages(fused: bool, data: st.DataObject) -> None:
    batch = data.draw(packed_loss_batches(advantages=st.just(0.0)), label="batch")
    batch = attrs.evolve(batch, advantages=np.zeros_like(batch.advantages))
    reduction = data.draw(st.sampled_from(losses.REDUCTIONS), label="reduction")
    for name in POLICY_KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        if name == "dro":
            # DRO's proximal term −(β/2)(lp − lp_old)² does not vanish with A; at β = 0 it must.
            config = config | {"beta": 0.0}
        loss, gradient, _ = _run(name, batch, reduction, **config, fused=fused)
        assert loss.item() == 0.0, name
        assert np.all(gradient == 0.0), name


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(data=st.data())
def test_masked_positions_change_nothing(
    dtype: torch.dtype, fused: bool, data: st.DataObject
) -> None:
    """Redrawing masked positions wildly (exp overflows there) changes no loss, gradient, metric."""
    batch = data.draw(packed_loss_batches(), label="batch")
    perturbed = data.draw(masked_perturbations(batch), label="perturbed")
    reduction = data.draw(st.sampled_from(losses.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = _run(name, batch, reduction, dtype, **config, fused=fused)
        perturbed_loss, perturbed_gradient, perturbed_metrics = _run(
            name, perturbed, reduction, dtype, **config, fused=fused
        )
        assert loss.dtype == dtype
        assert torch.isfinite(perturbed_loss), name
        assert np.all(np.isfinite(perturbed_gradient)), name
        assert torch.equal(loss, perturbed_loss), name
        np.testing.assert_array_equal(gradient, perturbed_gradient, err_msg=name)
        assert np.all(perturbed_gradient[~batch.mask] == 0.0), name
        assert metrics == perturbed_metrics, name


@PATHS
@given(data=st.data())
def test_sum_is_additive_over_any_split_of_the_batch_into_sequences(
    fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    split = data.draw(st.integers(0, len(batch.seq_lens)), label="split")
    cut = sum(batch.seq_lens[:split])

    def part(positions: slice, seq_lens: tuple[int, ...]) -> PackedLossBatch:
        return PackedLossBatch(
            logprobs=batch.logprobs[positions],
            sampling_logprobs=batch.sampling_logprobs[positions],
            advantages=batch.advantages[positions],
            mask=batch.mask[positions],
            seq_lens=seq_lens,
        )

    head = part(slice(0, cut), batch.seq_lens[:split])
    tail = part(slice(cut, None), batch.seq_lens[split:])
    tolerance = 1e-12 * _scale(batch)
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, _ = _run(name, batch, **config, fused=fused)
        head_loss, head_gradient, _ = _run(name, head, **config, fused=fused)
        tail_loss, tail_gradient, _ = _run(name, tail, **config, fused=fused)
        assert math.isclose(
            loss.item(), (head_loss + tail_loss).item(), rel_tol=1e-9, abs_tol=tolerance
        ), name
        np.testing.assert_array_equal(
            gradient, np.concatenate([head_gradient, tail_gradient]), err_msg=name
        )


@PATHS
@given(data=st.data())
def test_empty_selection_gives_zero_loss_and_zero_gradient(
    fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    nothing_trains = data.draw(
        masked_perturbations(attrs.evolve(batch, mask=np.zeros_like(batch.mask))), label="batch"
    )
    reduction = data.draw(st.sampled_from(losses.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = _run(name, nothing_trains, reduction, **config, fused=fused)
        assert loss.item() == 0.0, name
        assert np.all(gradient == 0.0), name
        # Ratio statistics of an empty selection are documented as 0.0.
        assert all(value == 0.0 for value in metrics.values()), (name, metrics)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_second_backward_through_the_same_loss_says_to_call_the_kernel_again(
    fused: bool,
) -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    loss, _ = losses.ppo(
        logprobs, torch.tensor([-1.1, -1.9, -0.5]), torch.tensor([1.0, -1.0, 0.5]), fused=fused
    )
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call the kernel again"):
        loss.backward()


def test_empty_batch_gives_zero_loss_and_empty_gradient() -> None:
    logprobs = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    for name in KERNELS:
        loss, metrics = losses.LOSSES[name](logprobs, torch.zeros(0), torch.zeros(0), seq_lens=[])
        loss.backward()
        assert loss.item() == 0.0
        assert metrics["train_tokens"] == 0.0


# --- numbers that would poison a step ----------------------------------------------------

NON_FINITE = [math.nan, math.inf, -math.inf]
VALUE_FIELDS = ("logprobs", "sampling_logprobs", "advantages")


def _caller_name(name: str, field: str) -> str:
    """What the error calls a field: cross_entropy's advantages are its weights."""
    return "weights" if field == "advantages" and name == "cross_entropy" else field


def _with_values(
    batch: PackedLossBatch, field: str, positions: np.ndarray, value: float
) -> PackedLossBatch:
    values = getattr(batch, field).copy()
    values[positions] = value
    return attrs.evolve(batch, **{field: values})


@PATHS
@pytest.mark.parametrize("field", VALUE_FIELDS)
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@given(data=st.data())
def test_a_non_finite_masked_in_value_raises_naming_the_tensor_and_first_index(
    field: str, value: float, fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    trained = np.flatnonzero(batch.mask)
    assume(trained.size > 0)
    picked = data.draw(
        st.lists(st.sampled_from(trained.tolist()), min_size=1, max_size=3), label="positions"
    )
    first = min(picked)
    # Masked-out NaN before the first bad index: the error must skip it.
    poisoned = _with_values(batch, field, np.flatnonzero(~batch.mask), math.nan)
    poisoned = _with_values(poisoned, field, np.array(picked), value)
    for name in KERNELS:  # cross_entropy too reads the sampling log-probs it is given
        expected = rf"^{_caller_name(name, field)}\[{first}\] is {value} at a masked-in position"
        with pytest.raises(ValueError, match=expected):
            _run(name, poisoned, fused=fused)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(data=st.data())
def test_non_finite_masked_out_values_change_nothing(
    dtype: torch.dtype, fused: bool, data: st.DataObject
) -> None:
    """NaN and ±inf at masked positions, in any input, give the clean batch's results."""
    batch = data.draw(packed_loss_batches(), label="batch")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    poisoned = batch
    for field in VALUE_FIELDS:
        values = getattr(poisoned, field).copy()
        wild = rng.choice(NON_FINITE + [0.0], values.size)
        values[~batch.mask] = wild[~batch.mask]
        poisoned = attrs.evolve(poisoned, **{field: values})
    reduction = data.draw(st.sampled_from(losses.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = _run(name, batch, reduction, dtype, **config, fused=fused)
        poisoned_loss, poisoned_gradient, poisoned_metrics = _run(
            name, poisoned, reduction, dtype, **config, fused=fused
        )
        assert torch.equal(loss, poisoned_loss), name
        np.testing.assert_array_equal(gradient, poisoned_gradient, err_msg=name)
        assert metrics == poisoned_metrics, name


@PATHS
@pytest.mark.parametrize("name", KERNELS)
def test_finite_values_whose_sums_overflow_do_not_raise(name: str, fused: bool) -> None:
    """The fast check's false alarm (a finite batch whose sum overflows) is ruled out exactly."""
    logprobs = torch.tensor([-3e38, -3e38, -1.0], dtype=torch.float32, requires_grad=True)
    sampling = torch.tensor([3e38, 3e38, -1.0])  # lp − lp_old overflows to −inf
    advantages = torch.tensor([1e38, 1e38, 1.0])
    kernel = losses.LOSSES[name]
    kernel(logprobs, sampling, advantages, fused=fused and kernel.fused_form is not None)


@PATHS
@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("name", KERNELS)
def test_a_non_binary_mask_raises_naming_the_first_bad_index(
    name: str, bad: float, fused: bool
) -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -0.7], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, bad, bad], dtype=torch.float64)
    kernel = losses.LOSSES[name]
    with pytest.raises(ValueError, match=rf"^mask\[2\] is {bad}, but a mask holds only 0 and 1"):
        kernel(
            logprobs,
            torch.tensor([-1.1, -1.9, -0.5, -0.6]),
            torch.tensor([1.0, -1.0, 0.5, 0.2]),
            mask=mask,
            fused=fused and kernel.fused_form is not None,
        )


@PATHS
@given(batch=packed_loss_batches())
def test_a_zero_one_mask_of_any_dtype_equals_the_bool_mask(
    fused: bool, batch: PackedLossBatch
) -> None:
    for name in KERNELS:
        kernel = losses.LOSSES[name]
        results = []
        for mask_dtype in (torch.bool, torch.float32, torch.int64):
            logprobs, sampling, advantages, mask = batch.tensors()
            loss, _ = kernel(
                logprobs,
                sampling,
                advantages,
                mask=mask.to(mask_dtype),
                seq_lens=batch.seq_lens,
                fused=fused and kernel.fused_form is not None,
            )
            loss.backward()
            results.append((loss.detach(), logprobs.grad))
        for loss, gradient in results[1:]:
            assert torch.equal(loss, results[0][0]), name
            assert torch.equal(gradient, results[0][1]), name


@PATHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(data=st.data())
def test_low_precision_inputs_are_computed_in_float32(
    dtype: torch.dtype, fused: bool, data: st.DataObject
) -> None:
    """float16/bfloat16 give exactly the float32 kernel on the same (rounded) values: a
    float32 loss, and the float32 gradient rounded once to the input dtype."""
    batch = data.draw(packed_loss_batches(), label="batch")
    reduction = data.draw(st.sampled_from(losses.REDUCTIONS), label="reduction")
    low, sampling, advantages, mask = batch.tensors(dtype)
    # Rounding to the low dtype may push a masked-in log-ratio past float32's exp range.
    wide = low.detach().float().requires_grad_(True)
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        kernel = losses.LOSSES[name]
        outputs = []
        for logprobs in (low, wide):
            logprobs.grad = None
            loss, metrics = kernel(
                logprobs,
                sampling,
                advantages,
                mask=mask,
                seq_lens=batch.seq_lens,
                reduction=reduction,
                norm_length=_norm_length(reduction),
                fused=fused and kernel.fused_form is not None,
                **config,
            )
            # Held until backward in the input dtype (half the memory of float32).
            assert loss.grad_fn.gradient.dtype == logprobs.dtype, name
            loss.backward()
            outputs.append((loss.detach(), logprobs.grad, metrics))
        (loss, gradient, metrics), (wide_loss, wide_gradient, wide_metrics) = outputs
        assert loss.dtype == torch.float32, name
        assert gradient is not None and gradient.dtype == dtype, name
        assert torch.equal(loss, wide_loss), name
        assert wide_gradient is not None
        assert torch.equal(gradient, wide_gradient.to(dtype)), name
        assert metrics == wide_metrics, name


@PATHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_ratio_beyond_the_low_precision_range_stays_finite(
    dtype: torch.dtype, fused: bool
) -> None:
    """exp(12) = 162755 overflows float16 (max 65504): computed in float32 it does not."""
    logprobs = torch.tensor([0.0, -1.0], dtype=dtype, requires_grad=True)
    sampling = torch.tensor([-12.0, -1.0], dtype=dtype)
    advantages = torch.tensor([1.0, 1.0], dtype=dtype)
    loss, metrics = losses.importance_sampling(logprobs, sampling, advantages, fused=fused)
    loss.backward()
    assert loss.item() == pytest.approx(-(math.exp(12.0) + 1.0), rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(math.exp(12.0), rel=1e-6)
    assert logprobs.grad is not None and logprobs.grad.dtype == dtype


# --- inputs and dtypes ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", KERNELS)
def test_kernels_keep_the_dtype_of_logprobs(name: str, dtype: torch.dtype) -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=dtype, requires_grad=True)
    loss, _ = losses.LOSSES[name](
        logprobs, torch.tensor([-1.1, -1.9, -0.5]), torch.tensor([1.0, -1.0, 0.5])
    )
    loss.backward()
    assert loss.dtype == dtype
    assert logprobs.grad is not None and logprobs.grad.dtype == dtype


@given(batch=packed_loss_batches())
def test_seq_lens_as_list_numpy_or_tensor_give_the_same_loss(batch: PackedLossBatch) -> None:
    logprobs, sampling_logprobs, advantages, mask = batch.tensors()
    results = [
        losses.gspo(
            logprobs,
            sampling_logprobs,
            advantages,
            mask=mask,
            seq_lens=seq_lens,
            reduction="token_mean",
        )[0]
        for seq_lens in (
            list(batch.seq_lens),
            np.array(batch.seq_lens),
            torch.tensor(batch.seq_lens),
        )
    ]
    assert all(torch.equal(result, results[0]) for result in results)


def test_no_mask_and_no_seq_lens_mean_all_positions_in_one_sequence() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    sampling_logprobs = torch.tensor([-1.2, -1.5, -0.5], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    implicit = losses.gspo(logprobs, sampling_logprobs, advantages)
    explicit = losses.gspo(
        logprobs, sampling_logprobs, advantages, mask=torch.ones(3, dtype=torch.bool), seq_lens=[3]
    )
    assert torch.equal(implicit[0], explicit[0])
    assert implicit[1] == explicit[1]


def test_mismatched_lengths_and_bad_seq_lens_raise_naming_the_field() -> None:
    logprobs = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="advantages has shape \\(2,\\)"):
        losses.ppo(logprobs, torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="sampling_logprobs has shape"):
        losses.ppo(logprobs, torch.zeros(4), torch.zeros(3))
    with pytest.raises(ValueError, match="mask has shape"):
        losses.ppo(logprobs, torch.zeros(3), torch.zeros(3), mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_lens sums to 4 but logprobs has 3"):
        losses.ppo(logprobs, torch.zeros(3), torch.zeros(3), seq_lens=[2, 2])
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        losses.ppo(logprobs, torch.zeros(3), torch.zeros(3), seq_lens=[4, -1])
    with pytest.raises(ValueError, match="seq_lens must hold integers"):
        losses.ppo(logprobs, torch.zeros(3), torch.zeros(3), seq_lens=[1.5, 1.5])
    with pytest.raises(ValueError, match="needs sampling_logprobs"):
        losses.ppo(logprobs, None, torch.zeros(3))
    with pytest.raises(ValueError, match="needs sampling_logprobs"):
        losses.gspo(logprobs, None, torch.zeros(3))
    with pytest.raises(ValueError, match="logprobs must be a floating tensor"):
        losses.ppo(torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(3))


# --- registry and configuration ---------------------------------------------------------


def test_registry_holds_every_kernel_under_its_module_name() -> None:
    assert set(losses.LOSSES) == {
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "cross_entropy",
    }
    for name, kernel in losses.LOSSES.items():
        assert getattr(losses, name) is kernel
        assert kernel.name == name
        assert losses.get_loss(name) is kernel
        assert kernel.__doc__ and "=" in kernel.__doc__, (
            "each kernel's docstring states its formula"
        )


def test_defaults_are_those_of_the_formulas_page() -> None:
    assert losses.resolve_config("ppo", {}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
        "dual_clip": None,
    }
    assert losses.resolve_config("cispo", {}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }
    assert losses.resolve_config("dro", {}) == {"beta": 0.05}
    assert losses.resolve_config("gspo", {}) == {
        "clip_low_threshold": 1 - 3e-4,
        "clip_high_threshold": 1 + 4e-4,
    }
    assert losses.resolve_config("importance_sampling", {}) == {}
    assert losses.resolve_config("cross_entropy", {}) == {}
    assert losses.gspo.sequence_level and not losses.ppo.sequence_level


def test_resolve_config_overrides_only_the_given_keys() -> None:
    assert losses.resolve_config("ppo", {"clip_high_threshold": 1.28, "dual_clip": 3}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
        "dual_clip": 3.0,
    }


def test_unknown_loss_name_raises_listing_the_known_names() -> None:
    with pytest.raises(
        ValueError, match="unknown loss 'grpo'; known losses: cispo, cross_entropy, dro"
    ):
        losses.get_loss("grpo")
    with pytest.raises(ValueError, match="unknown loss"):
        losses.resolve_config("grpo", {})


def test_unknown_config_key_raises_naming_the_key_and_the_valid_keys() -> None:
    with pytest.raises(
        ValueError,
        match="unknown config key 'clip_ratio' for loss 'ppo'; valid keys: "
        "clip_high_threshold, clip_low_threshold, dual_clip",
    ):
        losses.resolve_config("ppo", {"clip_ratio": 0.2})
    with pytest.raises(
        ValueError, match="unknown config key 'beta' for loss 'importance_sampling'"
    ):
        losses.resolve_config("importance_sampling", {"beta": 0.1})
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="unknown config key 'beta' for loss 'cispo'"):
        losses.cispo(logprobs, torch.zeros(2), torch.zeros(2), beta=0.1)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "ppo",
            {"clip_low_threshold": -0.1},
            "clip_low_threshold must be >= 0 for loss 'ppo', got -0.1",
        ),
        ("cispo", {"clip_high_threshold": -1.0}, "clip_high_threshold must be >= 0"),
        (
            "ppo",
            {"clip_low_threshold": 1.3},
            "clip_low_threshold \\(1.3\\) must not exceed clip_high_threshold \\(1.2\\)",
        ),
        ("gspo", {"clip_low_threshold": 1.1, "clip_high_threshold": 1.0}, "must not exceed"),
        ("ppo", {"dual_clip": 1.0}, "dual_clip must be > 1 for loss 'ppo', got 1.0"),
        ("ppo", {"dual_clip": 0.5}, "dual_clip must be > 1"),
        ("dro", {"beta": -0.05}, "beta must be >= 0 for loss 'dro', got -0.05"),
        ("dro", {"beta": math.inf}, "beta must be finite"),
        (
            "ppo",
            {"clip_high_threshold": math.nan},
            "clip_high_threshold must be a number .* got nan",
        ),
        (
            "ppo",
            {"clip_high_threshold": "1.2"},
            "clip_high_threshold must be a number .* got '1.2'",
        ),
        ("cispo", {"clip_low_threshold": None}, "clip_low_threshold must be a number .* got None"),
    ],
)
def test_invalid_thresholds_raise_naming_the_key_and_value(
    name: str, config: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        losses.resolve_config(name, config)
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        losses.LOSSES[name](logprobs, torch.zeros(2), torch.zeros(2), **config)


def test_unknown_reduction_raises_listing_the_reductions() -> None:
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="unknown reduction 'mean'; choose one of sum, token_mean"):
        losses.ppo(logprobs, torch.zeros(2), torch.zeros(2), reduction="mean")


@pytest.mark.parametrize("norm_length", [None, 0.0, -4.0, math.nan, math.inf])
def test_seq_mean_token_sum_norm_needs_a_positive_norm_length(norm_length: float | None) -> None:
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="norm_length"):
        losses.ppo(
            logprobs,
            torch.zeros(2),
            torch.zeros(2),
            reduction="seq_mean_token_sum_norm",
            norm_length=norm_length,
        )


def test_norm_length_with_another_reduction_raises() -> None:
    with pytest.raises(
        ValueError, match="norm_length=16 is only used by reduction 'seq_mean_token_sum_norm'"
    ):
        losses.validate_reduction("token_mean", 16)


# --- KL estimators ----------------------------------------------------------------------


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
    actual = losses.kl_penalty(logprobs, ref_logprobs, estimator=estimator)
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-9, atol=1e-15)
    assert losses.KL_ESTIMATORS[estimator] is not None


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
    assert torch.all(losses.kl_penalty(current, reference) >= 0)
    assert torch.all(losses.kl_penalty(current, current) == 0)


def test_unknown_kl_estimator_raises_listing_the_estimators() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of k1, k2, k3"):
        losses.kl_penalty(torch.zeros(2), torch.zeros(2), estimator="k4")
