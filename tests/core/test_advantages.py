"""Tests for grpo.core.advantages: the laws of docs/FORMULAS.md "Group advantages"."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.advantages import (
    ADVANTAGES,
    STD_EPSILON,
    batch_standardize,
    center,
    degenerate_groups,
    group_advantages,
    rloo,
    standardize,
)
from tests.strategies import dyadic_reward_batches, group_rewards, reward_batches

METHODS = sorted(ADVANTAGES)
PER_GROUP = {"center": center, "standardize": standardize, "rloo": rloo}


def _split(values_N, sizes_B):
    return np.split(values_N, np.cumsum(sizes_B)[:-1])


def _scale(rewards):
    return max(1.0, float(np.max(np.abs(rewards))))


def _rounding_atol(rewards, denominator=1.0):
    """Tolerance between two summation orders: a few ulps of the rewards, divided as A is."""
    return 1e-12 + 4 * rewards.size * np.finfo(np.float64).eps * _scale(rewards) / denominator


@given(batch=reward_batches())
def test_center_sums_to_zero_per_group(batch):
    rewards, sizes = batch
    advantages = group_advantages(rewards, sizes, "center").advantages
    for advantages_G in _split(advantages, sizes):
        assert abs(advantages_G.sum()) <= 1e-12 * _scale(rewards) * advantages_G.size


@pytest.mark.parametrize("method", METHODS)
@given(batch=dyadic_reward_batches(), shift=st.integers(-4096, 4096).map(lambda k: k / 64))
def test_adding_a_constant_to_the_rewards_changes_no_advantage(method, batch, shift):
    rewards, sizes = batch
    before = group_advantages(rewards, sizes, method)
    after = group_advantages(rewards + shift, sizes, method)
    np.testing.assert_allclose(after.advantages, before.advantages, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(after.degenerate, before.degenerate)


@given(batch=reward_batches(), k=st.floats(1e-2, 1e2))
def test_scaling_rewards_by_k_scales_center_and_rloo_by_k(batch, k):
    rewards, sizes = batch
    for method in ("center", "rloo"):
        expected = k * group_advantages(rewards, sizes, method).advantages
        actual = group_advantages(k * rewards, sizes, method).advantages
        np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9 * k * _scale(rewards))


@given(batch=dyadic_reward_batches(), k=st.floats(1e-2, 1e2))
def test_scaling_rewards_by_k_leaves_standardize_unchanged(batch, k):
    rewards, sizes = batch
    before = group_advantages(rewards, sizes, "standardize").advantages
    after = group_advantages(k * rewards, sizes, "standardize").advantages
    # With c = R − mean and s = std, c/(s+ε) − k·c/(k·s+ε) = c·ε·(1−k) / ((s+ε)(k·s+ε)),
    # and |c| <= sqrt(G)·s, so the only change is ε's share: at most sqrt(G)·ε·|1−k| / (k·s).
    for before_G, after_G, rewards_G in zip(
        _split(before, sizes), _split(after, sizes), _split(rewards, sizes)
    ):
        std = np.std(rewards_G)
        if std == 0:
            assert not after_G.any()
            continue
        bound = np.sqrt(rewards_G.size) * STD_EPSILON * abs(1 - k) / (k * std) + 1e-9
        np.testing.assert_allclose(after_G, before_G, rtol=0, atol=bound)


@given(batch=reward_batches())
def test_rloo_is_reward_minus_mean_of_the_others(batch):
    rewards, sizes = batch
    advantages = group_advantages(rewards, sizes, "rloo").advantages
    for rewards_G, advantages_G in zip(_split(rewards, sizes), _split(advantages, sizes)):
        if rewards_G.size == 1:
            assert advantages_G.tolist() == [0.0]
            continue
        leave_one_out = np.array(
            [rewards_G[i] - np.delete(rewards_G, i).mean() for i in range(rewards_G.size)]
        )
        np.testing.assert_allclose(
            advantages_G, leave_one_out, rtol=1e-9, atol=1e-9 * _scale(rewards_G)
        )


@pytest.mark.parametrize("method", METHODS)
@given(batch=reward_batches())
def test_degenerate_groups_get_exactly_zero_advantages_and_are_flagged(method, batch):
    rewards, sizes = batch
    result = group_advantages(rewards, sizes, method)
    all_equal = np.array([np.all(r == r[0]) for r in _split(rewards, sizes)])
    np.testing.assert_array_equal(result.degenerate, all_equal)
    np.testing.assert_array_equal(degenerate_groups(rewards, sizes), all_equal)
    for advantages_G, is_degenerate in zip(result.split(), all_equal):
        if is_degenerate:
            assert not advantages_G.any()


def test_a_group_of_equal_unrepresentable_rewards_gives_exact_zeros():
    # mean([0.1] * 3) is 0.10000000000000002, so R − mean would leave -1.4e-17 behind.
    for method in METHODS:
        result = group_advantages([0.1] * 3, [3], method)
        assert result.advantages.tolist() == [0.0] * 3
        assert result.degenerate.tolist() == [True]
    for method, advantage_fn in PER_GROUP.items():
        assert advantage_fn([0.1] * 3).tolist() == [0.0] * 3, method


@pytest.mark.parametrize("method", sorted(PER_GROUP))
@given(batch=reward_batches())
def test_vectorized_advantages_equal_the_per_group_functions(method, batch):
    rewards, sizes = batch
    vectorized = group_advantages(rewards, sizes, method).advantages
    for rewards_G, vectorized_G in zip(_split(rewards, sizes), _split(vectorized, sizes)):
        # standardize divides the rounding of the mean by std + ε, so it can grow to ~ulp/ε.
        denominator = np.std(rewards_G) + STD_EPSILON if method == "standardize" else 1.0
        np.testing.assert_allclose(
            vectorized_G,
            PER_GROUP[method](rewards_G),
            rtol=1e-9,
            atol=_rounding_atol(rewards_G, denominator),
        )


@given(rewards=st.integers(1, 8).flatmap(group_rewards))
def test_batch_standardize_of_one_group_equals_standardize(rewards):
    rewards = np.array(rewards)
    denominator = np.std(rewards) + STD_EPSILON
    np.testing.assert_allclose(
        batch_standardize(rewards, [rewards.size]),
        standardize(rewards),
        rtol=1e-9,
        atol=_rounding_atol(rewards, denominator),
    )


@given(batch=reward_batches())
def test_batch_standardize_divides_centered_rewards_by_their_batch_std(batch):
    rewards, sizes = batch
    centered = np.concatenate([center(r) for r in _split(rewards, sizes)])
    denominator = np.sqrt(np.mean(centered**2)) + STD_EPSILON
    actual = group_advantages(rewards, sizes, "batch_standardize").advantages
    np.testing.assert_allclose(
        actual, centered / denominator, rtol=1e-9, atol=_rounding_atol(rewards, denominator)
    )


@given(
    rewards=st.integers(2, 8).flatmap(
        lambda size: st.lists(st.integers(-64, 64), min_size=size, max_size=size)
    )
)
def test_standardized_advantages_have_zero_mean_and_unit_population_std(rewards):
    rewards = np.array(rewards, dtype=np.float64)
    advantages = standardize(rewards)
    if np.all(rewards == rewards[0]):
        assert not advantages.any()
        return
    assert abs(advantages.mean()) < 1e-12
    assert np.sqrt(np.mean(advantages**2)) == pytest.approx(1.0, rel=1e-6)


def test_standardize_of_zero_and_one_is_minus_one_and_one():
    np.testing.assert_allclose(standardize([0.0, 1.0]), [-1.0, 1.0], rtol=1e-7)


@given(
    base=st.floats(-1e3, 1e3),
    spread=st.sampled_from([1e-15, 1e-12, 1e-9, 1e-6, 1.0]),
    steps=st.lists(st.integers(0, 3), min_size=2, max_size=8),
)
def test_near_constant_groups_never_get_huge_advantages(base, spread, steps):
    rewards = base + spread * np.array(steps, dtype=np.float64)
    size = rewards.size
    reward_range = rewards.max() - rewards.min()
    assert np.all(np.abs(standardize(rewards)) <= np.sqrt(size - 1) + 1e-9)
    assert np.all(np.abs(batch_standardize(rewards, [size])) <= np.sqrt(size - 1) + 1e-9)
    assert np.all(np.abs(center(rewards)) <= reward_range + 1e-12 * _scale(rewards))
    assert np.all(
        np.abs(rloo(rewards)) <= size / (size - 1) * reward_range + 1e-12 * _scale(rewards)
    )


def test_a_tiny_reward_difference_gives_a_tiny_standardized_advantage():
    assert np.all(np.abs(standardize([0.0, 1e-12])) < 1e-3)


def test_rloo_of_a_single_completion_is_zero():
    assert rloo([3.0]).tolist() == [0.0]


def test_unknown_method_error_lists_the_known_methods():
    with pytest.raises(
        ValueError,
        match="unknown advantage method 'grpo'; choose one of center, standardize, rloo, "
        "batch_standardize",
    ):
        group_advantages([1.0, 0.0], [2], "grpo")


@pytest.mark.parametrize(
    ("rewards", "sizes", "message"),
    [
        ([1.0, 0.0, 1.0], [2, 2], "group_sizes_B sum to 4 but rewards_N has 3 entries"),
        ([1.0, 0.0], [2, 0], r"group_sizes_B must all be >= 1, got \[2, 0\]"),
        ([1.0, float("nan")], [2], r"rewards_N\[1\] = nan is not finite"),
        ([[1.0, 0.0]], [2], r"rewards_N must be a 1-D array of rewards, got shape \(1, 2\)"),
        ([1.0, 0.0], [2.0], "group_sizes_B must hold integers, got dtype float64"),
    ],
)
def test_bad_batches_are_rejected_with_the_field_and_value(rewards, sizes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        group_advantages(rewards, sizes, "center")


def test_an_empty_group_is_rejected_by_the_per_group_functions():
    with pytest.raises(ValueError, match="rewards_G is empty"):
        center([])


def test_an_empty_batch_gives_no_advantages():
    result = group_advantages([], np.zeros(0, dtype=np.int64), "standardize")
    assert result.advantages.size == 0 and result.degenerate.size == 0
