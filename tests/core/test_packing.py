"""The kernels' inputs as grpo.core.packing checks and packs them, through every kernel:
masked positions, empty selections, non-finite values, masks, dtypes and seq_lens."""

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
    norm_length_for,
    reference,
    run_kernel,
)
from tests.strategies import (
    LOSS_CONFIGS,
    PackedLossBatch,
    masked_perturbations,
    packed_loss_batches,
)

pytestmark = pytest.mark.usefixtures("uncompiled_fused_forms")


# --- masked positions and empty selections ---------------------------------------------


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(data=st.data())
def test_masked_positions_change_nothing(
    dtype: torch.dtype, fused: bool, data: st.DataObject
) -> None:
    """Redrawing masked positions wildly (exp overflows there) changes no loss, gradient, metric."""
    batch = data.draw(packed_loss_batches(), label="batch")
    perturbed = data.draw(masked_perturbations(batch), label="perturbed")
    reduction = data.draw(st.sampled_from(reductions.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = run_kernel(name, batch, reduction, dtype, **config, fused=fused)
        perturbed_loss, perturbed_gradient, perturbed_metrics = run_kernel(
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
def test_empty_selection_gives_zero_loss_and_zero_gradient(
    fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    nothing_trains = data.draw(
        masked_perturbations(attrs.evolve(batch, mask=np.zeros_like(batch.mask))), label="batch"
    )
    reduction = data.draw(st.sampled_from(reductions.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = run_kernel(name, nothing_trains, reduction, **config, fused=fused)
        assert loss.item() == 0.0, name
        assert np.all(gradient == 0.0), name
        # Ratio statistics of an empty selection are documented as 0.0.
        assert all(value == 0.0 for value in metrics.values()), (name, metrics)


def test_empty_batch_gives_zero_loss_and_empty_gradient() -> None:
    logprobs = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    for name in KERNELS:
        loss, metrics = losses.LOSSES[name](logprobs, torch.zeros(0), torch.zeros(0), seq_lens=[])
        loss.backward()
        assert loss.item() == 0.0
        assert metrics["train_tokens"] == 0.0


# --- numbers that would poison a step --------------------------------------------------


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
            run_kernel(name, poisoned, fused=fused)


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
    reduction = data.draw(st.sampled_from(reductions.REDUCTIONS), label="reduction")
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, metrics = run_kernel(name, batch, reduction, dtype, **config, fused=fused)
        poisoned_loss, poisoned_gradient, poisoned_metrics = run_kernel(
            name, poisoned, reduction, dtype, **config, fused=fused
        )
        assert torch.equal(loss, poisoned_loss), name
        np.testing.assert_array_equal(gradient, poisoned_gradient, err_msg=name)
        assert metrics == poisoned_metrics, name


@PATHS
@pytest.mark.parametrize("name", KERNELS)
def test_finite_values_whose_check_sum_overflows_train_as_the_reference_says(
    name: str, fused: bool
) -> None:
    """The eager check's false alarm, a finite batch whose Σ_t (lp − lp_old)·A overflows
    float32 (−1e10 · 1e38), is ruled out exactly: the call gives the finite loss, gradient
    and metrics of the per-token float64 reference (the fused form runs unchanged)."""
    batch = PackedLossBatch(
        logprobs=np.array([-1.0, -1.0, -1.0, -0.5]),
        sampling_logprobs=np.array([1e10, 1e10, -1.5, -0.7]),
        advantages=np.array([1e38, 1e38, 1.0, 2.0]),
        mask=np.array([True, True, True, False]),
        seq_lens=(2, 2),
    )
    logprobs, sampling, advantages, mask = batch.tensors(torch.float32)
    log_ratio = torch.where(mask, logprobs.detach() - sampling, 0.0)
    assert not torch.isfinite(torch.dot(log_ratio, advantages))  # the false alarm fires
    loss, gradient, metrics = run_kernel(name, batch, "sum", torch.float32, fused=fused)
    expected_loss, expected_gradient, expected_metrics = reference(name, {}, batch, "sum")
    assert math.isfinite(loss.item()) and np.all(np.isfinite(gradient)), name
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-6, atol=0)
    assert metrics == pytest.approx(expected_metrics | {"loss": expected_loss}, rel=1e-6)


@pytest.mark.parametrize("name", KERNELS)
def test_a_log_ratio_that_overflows_gives_the_fused_path_the_eager_result(name: str) -> None:
    """Finite float32 inputs whose lp − lp_old overflows (−3e38 − 3e38): the fused form's
    finiteness probe is NaN there, so the call must fall back to the eager kernel and
    return exactly its loss, gradient and metrics (never a NaN loss with no bad input)."""
    batch = PackedLossBatch(
        logprobs=np.array([-3e38, -3e38, -1.0]),
        sampling_logprobs=np.array([3e38, 3e38, -1.0]),
        advantages=np.array([1e38, 1e38, 1.0]),
        mask=np.array([True, True, True]),
        seq_lens=(3,),
    )
    eager = run_kernel(name, batch, "sum", torch.float32, fused=False)
    fused = run_kernel(name, batch, "sum", torch.float32, fused=True)
    assert not math.isnan(fused[0].item()), name
    assert torch.equal(eager[0], fused[0]), (name, eager[0], fused[0])
    np.testing.assert_array_equal(eager[1], fused[1], err_msg=name)
    assert eager[2] == fused[2], name


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
    reduction = data.draw(st.sampled_from(reductions.REDUCTIONS), label="reduction")
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
                norm_length=norm_length_for(reduction),
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


# --- inputs and dtypes -----------------------------------------------------------------


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
