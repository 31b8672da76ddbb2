"""Loss kernels against a per-token reference written from docs/FORMULAS.md, and their laws."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from grpo.core import losses, reductions
from tests.core.kernel_reference import (
    KERNELS,
    PATHS,
    POLICY_KERNELS,
    assert_metrics_close,
    norm_length_for,
    reference,
    run_kernel,
    term_scale,
)
from tests.strategies import (
    LOSS_CONFIGS,
    PackedLossBatch,
    packed_loss_batches,
)

pytestmark = pytest.mark.usefixtures("uncompiled_fused_forms")


@PATHS
@pytest.mark.parametrize("name", KERNELS)
@given(data=st.data())
def test_kernel_matches_per_token_reference_loss_gradient_and_metrics(
    name: str, fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    config = data.draw(LOSS_CONFIGS[name], label="config")
    tolerance = 1e-12 * term_scale(batch)
    for reduction in reductions.REDUCTIONS:
        loss, gradient, metrics = run_kernel(name, batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = reference(
            name, config, batch, reduction, norm_length_for(reduction)
        )
        assert loss.dtype == torch.float64
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=tolerance), reduction
        np.testing.assert_allclose(
            gradient, expected_gradient, rtol=1e-9, atol=1e-12, err_msg=reduction
        )
        expected_metrics["loss"] = loss.item()
        assert_metrics_close(metrics, expected_metrics)


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
    for reduction in reductions.REDUCTIONS:
        loss, gradient, metrics = run_kernel(name, batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = reference(
            name, config, batch, reduction, norm_length_for(reduction)
        )
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=1e-12), reduction
        np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-9, atol=1e-12)
        assert_metrics_close(metrics, expected_metrics | {"loss": loss.item()})


@given(batch=packed_loss_batches())
def test_cross_entropy_without_sampling_logprobs_reports_only_loss_and_tokens(
    batch: PackedLossBatch,
) -> None:
    logprobs, _, weights, mask = batch.tensors()
    loss, metrics = losses.cross_entropy(logprobs, None, weights, mask=mask)
    expected_loss, _, _ = reference("cross_entropy", {}, batch, "sum")
    assert math.isclose(
        loss.item(), expected_loss, rel_tol=1e-12, abs_tol=1e-12 * term_scale(batch)
    )
    assert metrics == {"loss": loss.item(), "train_tokens": float(batch.mask.sum())}


# --- laws ------------------------------------------------------------------------------


@PATHS
@given(batch=packed_loss_batches(), reduction=st.sampled_from(reductions.REDUCTIONS))
def test_importance_sampling_equals_ppo_with_bounds_zero_and_infinity(
    fused: bool, batch: PackedLossBatch, reduction: str
) -> None:
    is_loss, is_gradient, is_metrics = run_kernel(
        "importance_sampling", batch, reduction, fused=fused
    )
    ppo_loss, ppo_gradient, ppo_metrics = run_kernel(
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
    _, gradient, _ = run_kernel("cispo", batch, **config, fused=fused)
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
    loss, gradient, _ = run_kernel("cispo", batch, **config, fused=fused)
    bound_loss, bound_gradient, _ = run_kernel("cispo", on_bounds, **config, fused=fused)
    tolerance = 1e-12 * term_scale(batch)
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
    _, gradient, metrics = run_kernel("ppo", batch, **resolved, fused=fused)
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
    plain_loss, plain_gradient, _ = run_kernel("ppo", batch, **plain, fused=fused)
    dual_loss, dual_gradient, _ = run_kernel(
        "ppo", batch, **(plain | {"dual_clip": dual_clip}), fused=fused
    )
    assert np.all(dual_gradient[dual_active] == 0.0)
    np.testing.assert_array_equal(dual_gradient[~dual_active], plain_gradient[~dual_active])
    # The loss is −Σ o, so replacing max(r, lo)·A by c·A on active tokens shifts it by:
    shift = -np.sum(((dual_clip - np.maximum(ratio, low)) * advantages)[dual_active])
    assert math.isclose(
        (dual_loss - plain_loss).item(), shift, rel_tol=1e-9, abs_tol=1e-12 * term_scale(batch)
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
    tolerance = 1e-12 * term_scale(batch)
    for reduction in reductions.REDUCTIONS:
        loss, gradient, metrics = run_kernel("ppo", batch, reduction, **config, fused=fused)
        expected_loss, expected_gradient, expected_metrics = reference(
            "ppo", config, batch, reduction, norm_length_for(reduction)
        )
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9, abs_tol=tolerance), reduction
        np.testing.assert_allclose(
            gradient, expected_gradient, rtol=1e-9, atol=1e-12, err_msg=reduction
        )
        assert_metrics_close(metrics, expected_metrics | {"loss": loss.item()})


@PATHS
@pytest.mark.parametrize("name", KERNELS)
@given(
    data=st.data(),
    reduction=st.sampled_from(reductions.REDUCTIONS),
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
    _, gradient, _ = run_kernel(name, batch, reduction, **config, fused=fused, scale=scale)
    _, expected_gradient, _ = reference(name, config, batch, reduction, norm_length_for(reduction))
    np.testing.assert_allclose(
        gradient, scale * expected_gradient, rtol=1e-9, atol=1e-12 * abs(scale)
    )


@PATHS
@given(data=st.data())
def test_policy_losses_are_zero_with_zero_advantages(fused: bool, data: st.DataObject) -> None:
    batch = data.draw(packed_loss_batches(advantages=st.just(0.0)), label="batch")
    batch = attrs.evolve(batch, advantages=np.zeros_like(batch.advantages))
    reduction = data.draw(st.sampled_from(reductions.REDUCTIONS), label="reduction")
    for name in POLICY_KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        if name == "dro":
            # DRO's proximal term −(β/2)(lp − lp_old)² does not vanish with A; at β = 0 it must.
            config = config | {"beta": 0.0}
        loss, gradient, _ = run_kernel(name, batch, reduction, **config, fused=fused)
        assert loss.item() == 0.0, name
        assert np.all(gradient == 0.0), name


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


# --- registry and configuration --------------------------------------------------------


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
