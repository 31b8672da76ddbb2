"""Laws of the helpers that moved from the loop to the core: KL shaping, pass@k, update
metrics, minibatches (docs/FORMULAS.md)."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.advantages import kl_shaped_advantages
from grpo.core.alignment import minibatches, pack_groups
from grpo.core.kl import KL_ESTIMATORS
from grpo.core.loss_spec import LossSpec
from grpo.core.metrics import pass_at_k, update_metrics
from tests.strategies import scored_groups

finite = st.floats(-5.0, 5.0, allow_nan=False)


@st.composite
def shaping_inputs(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    size = draw(st.integers(1, 12))
    arrays = [np.array(draw(st.lists(finite, min_size=size, max_size=size))) for _ in range(3)]
    mask = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=np.float64)
    return (*arrays, mask)


def _reference_kl(delta: float, estimator: str) -> float:
    return {"k1": delta, "k2": delta * delta / 2, "k3": math.exp(-delta) + delta - 1}[estimator]


@given(shaping_inputs(), st.floats(0.0, 2.0), st.sampled_from(sorted(KL_ESTIMATORS)))
def test_kl_shaping_subtracts_coef_times_estimate_on_trained_tokens_only(
    inputs: tuple[np.ndarray, ...], kl_coef: float, estimator: str
) -> None:
    advantages, sampled, reference, mask = inputs
    shaped, kl_mean = kl_shaped_advantages(
        advantages, sampled, reference, mask, kl_coef=kl_coef, estimator=estimator
    )
    estimates = [_reference_kl(s - r, estimator) for s, r in zip(sampled, reference, strict=True)]
    for t, trained in enumerate(mask.astype(bool)):
        expected = advantages[t] - kl_coef * estimates[t] if trained else 0.0
        assert shaped[t] == pytest.approx(expected, abs=1e-9)
    trained_estimates = [e for e, m in zip(estimates, mask, strict=True) if m]
    expected_mean = sum(trained_estimates) / len(trained_estimates) if trained_estimates else 0.0
    assert kl_mean == pytest.approx(expected_mean, abs=1e-9)


@given(shaping_inputs(), st.sampled_from(sorted(KL_ESTIMATORS)))
def test_kl_shaping_with_zero_coef_keeps_trained_advantages(
    inputs: tuple[np.ndarray, ...], estimator: str
) -> None:
    advantages, sampled, reference, mask = inputs
    shaped, _ = kl_shaped_advantages(
        advantages, sampled, reference, mask, kl_coef=0.0, estimator=estimator
    )
    np.testing.assert_array_equal(shaped, np.where(mask.astype(bool), advantages, 0.0))


def test_kl_shaping_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must have one shape"):
        kl_shaped_advantages(
            np.zeros(3), np.zeros(3), np.zeros(2), np.ones(3), kl_coef=1.0, estimator="k1"
        )


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """P(some of k draws without replacement is correct), by listing every k-subset."""
    outcomes = [any(index < c for index in subset) for subset in combinations(range(n), k)]
    return sum(outcomes) / len(outcomes)


@given(
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))
)
def test_pass_at_k_equals_the_probability_over_all_k_subsets(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k), abs=1e-12)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_1_is_the_fraction_correct(nc: tuple[int, int]) -> None:
    n, c = nc
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


@given(st.lists(scored_groups(), min_size=1, max_size=4), st.integers(1, 6))
def test_minibatches_are_contiguous_near_equal_and_cover_the_batch(groups, parts: int) -> None:
    batch = pack_groups(groups, drop_degenerate=False)
    pieces = minibatches(batch, parts)
    sizes = [piece.num_sequences for piece in pieces]
    assert sum(sizes) == batch.num_sequences
    assert len(pieces) == min(parts, batch.num_sequences)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for name in (
        "input_tokens",
        "target_tokens",
        "sampling_logprobs",
        "advantages",
        "mask",
        "seq_lens",
    ):
        joined = np.concatenate([getattr(piece, name) for piece in pieces])
        np.testing.assert_array_equal(joined, getattr(batch, name))


def test_minibatches_rejects_zero_parts() -> None:
    with pytest.raises(ValueError, match="num_minibatches must be >= 1"):
        minibatches(pack_groups([], drop_degenerate=False), 0)


@given(st.lists(scored_groups(), min_size=1, max_size=3), st.floats(-0.5, 0.5))
def test_update_metrics_ratio_statistics_over_trained_tokens(groups, shift: float) -> None:
    batch = pack_groups(groups, drop_degenerate=False)
    trained = np.asarray(batch.mask, dtype=bool)
    # Untrained positions get a far larger shift: they must not reach the statistics.
    shifts = np.where(trained, np.float32(shift), np.float32(3.0))
    current = np.asarray(batch.sampling_logprobs, dtype=np.float32) + shifts
    metrics = update_metrics(LossSpec.build("ppo"), current, batch)
    log_ratio = (current - np.asarray(batch.sampling_logprobs, dtype=np.float32))[trained]
    if trained.any():
        assert metrics["ratio/max_abs_log"] == pytest.approx(
            float(np.abs(log_ratio).max()), abs=1e-6
        )
        assert metrics["ratio/mean"] == pytest.approx(float(np.exp(log_ratio).mean()), rel=1e-5)
    else:
        assert metrics["ratio/max_abs_log"] == 0.0 and metrics["ratio/mean"] == 1.0
    loss, kernel_metrics = LossSpec.build("ppo")(
        torch.from_numpy(current),
        torch.from_numpy(np.asarray(batch.sampling_logprobs, dtype=np.float32)),
        torch.from_numpy(np.asarray(batch.advantages, dtype=np.float32)),
        mask=torch.from_numpy(np.asarray(batch.mask, dtype=np.float32)),
        seq_lens=torch.tensor(batch.seq_lens),
    )
    assert metrics["loss"] == float(loss)
    assert metrics["ppo/clip_fraction"] == kernel_metrics["clip_fraction"]
