"""grpo.core.evaluation against plain references (docs/FORMULAS.md, "Evaluation metrics")."""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.evaluation import (
    EvalSamples,
    Interval,
    bootstrap_interval,
    cons_at_n,
    evaluation_metrics,
    intervals_overlap,
    majority_index,
    pass_at_k,
    powers_of_two,
    problem_values,
    seed_summary,
    student_t_quantile,
    t_interval,
)
from tests.strategies import eval_samples

TOLERANCE = 1e-12


def plain_pass_at_k(correct_G: list[bool], k: int) -> float:
    """The share of k-subsets of the samples holding a correct one (what pass@k estimates)."""
    subsets = list(combinations(correct_G, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def plain_cons(correct_G: list[bool], answers_G: list[str | None]) -> float:
    """Majority vote by Counter; ties to the answer that appears first."""
    votes = Counter(a for a in answers_G if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    for index, answer in enumerate(answers_G):
        if answer is not None and votes[answer] == top:
            return float(correct_G[index])
    raise AssertionError("unreachable")


def plain_metrics(samples: EvalSamples) -> dict[str, float]:
    """Every metric by loops over problems and samples."""
    rows = samples.correct_PG.tolist()
    n, problems = samples.num_samples, samples.num_problems

    def mean_over(per_problem: list[float]) -> float:
        return sum(per_problem) / problems

    metrics = {f"avg@{n}": mean_over([sum(row) / n for row in rows])}
    k = 1
    while k <= n:
        metrics[f"pass@{k}"] = mean_over([plain_pass_at_k(row, k) for row in rows])
        k *= 2
    metrics[f"cons@{n}"] = mean_over(
        [plain_cons(row, list(a)) for row, a in zip(rows, samples.answers_PG, strict=True)]
    )
    metrics["format_rate"] = mean_over(
        [sum(a is not None for a in answers) / n for answers in samples.answers_PG]
    )
    for name, array in (
        ("truncation_rate", samples.truncated_PG),
        ("avg_gen_len", samples.tokens_PG),
        ("reward", samples.reward_PG),
        ("turns", samples.turns_PG),
        ("tool_calls", samples.tool_calls_PG),
    ):
        if array is not None:
            metrics[name] = mean_over([sum(row) / n for row in array.tolist()])
    return metrics


@given(eval_samples())
def test_every_metric_equals_its_plain_reference(samples: EvalSamples) -> None:
    metrics = evaluation_metrics(samples, prefix="test/")
    expected = {f"test/{name}": value for name, value in plain_metrics(samples).items()}
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=TOLERANCE), name


@given(eval_samples())
def test_the_laws_pass1_is_avg_pass_rises_in_k_cons_at_most_pass_at_n(
    samples: EvalSamples,
) -> None:
    values = problem_values(samples)
    n = samples.num_samples
    np.testing.assert_allclose(values["pass@1"], values[f"avg@{n}"], atol=TOLERANCE)
    ks = powers_of_two(n)
    for smaller, larger in zip(ks, ks[1:], strict=False):
        assert np.all(values[f"pass@{smaller}"] <= values[f"pass@{larger}"] + TOLERANCE)
    correct_any = samples.correct_PG.any(axis=1)
    assert np.all(values[f"cons@{n}"] <= correct_any)
    for name in (f"avg@{n}", f"cons@{n}", "format_rate", "truncation_rate"):
        assert np.all((values[name] >= 0) & (values[name] <= 1)), name


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_is_zero_without_a_correct_sample_and_one_with_all(nc: tuple[int, int]) -> None:
    n, c = nc
    correct = np.zeros((1, n), dtype=bool)
    correct[0, :c] = True
    for k in powers_of_two(n):
        value = pass_at_k(correct, k)[0]
        assert value == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=TOLERANCE)
        if c == 0:
            assert value == 0.0
        if c == n:
            assert value == 1.0


def test_majority_ties_go_to_the_answer_given_first_and_none_never_votes() -> None:
    assert majority_index(["b", "a", "a", "b"]) == 0
    assert majority_index([None, "a", "b", "b", None, "a"]) == 1
    assert majority_index([None, None]) is None
    assert majority_index([None, "x", "y", "y"]) == 2
    correct = np.array([[False, True, True, False]])
    assert cons_at_n(correct, [["b", "a", "a", "b"]])[0] == 0.0
    assert cons_at_n(correct, [["b", "a", "a", None]])[0] == 1.0
    assert cons_at_n(correct, [[None, None, None, None]])[0] == 0.0


def test_powers_of_two_are_the_pass_at_k_sizes() -> None:
    assert powers_of_two(1) == (1,)
    assert powers_of_two(8) == (1, 2, 4, 8)
    assert powers_of_two(12) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="n must be >= 1"):
        powers_of_two(0)


def plain_bootstrap(values_EP: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """The percentile bootstrap by a loop over the same draws."""
    per_problem = values_EP.mean(axis=0)
    draws = np.random.default_rng(seed).integers(
        0, per_problem.size, size=(resamples, per_problem.size)
    )
    means = sorted(sum(per_problem[i] for i in row) / per_problem.size for row in draws)
    return tuple(float(q) for q in np.quantile(means, [0.025, 0.975]))  # type: ignore[return-value]


@given(
    st.integers(1, 3),
    st.integers(1, 12),
    st.integers(0, 2**32 - 1),
    st.integers(0, 100),
)
def test_bootstrap_interval_equals_a_loop_over_its_draws_and_brackets_a_constant(
    seeds: int, problems: int, data_seed: int, bootstrap_seed: int
) -> None:
    values = np.random.default_rng(data_seed).random((seeds, problems))
    interval = bootstrap_interval(values, resamples=200, seed=bootstrap_seed)
    low, high = plain_bootstrap(values, 200, bootstrap_seed)
    assert interval.low == pytest.approx(low, abs=TOLERANCE)
    assert interval.high == pytest.approx(high, abs=TOLERANCE)
    assert values.mean(axis=0).min() - TOLERANCE <= interval.low <= interval.high
    assert interval.high <= values.mean(axis=0).max() + TOLERANCE
    constant = bootstrap_interval(np.full((seeds, problems), 0.25), resamples=50)
    assert constant.low == pytest.approx(0.25) and constant.high == pytest.approx(0.25)


@given(eval_samples(max_problems=4, max_samples=4), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_seed_summary_means_the_seeds_and_lists_each(
    first: EvalSamples, seeds: int, data_seed: int
) -> None:
    rng = np.random.default_rng(data_seed)
    samples_E = [
        attrs.evolve(first, correct_PG=rng.random(first.correct_PG.shape) < 0.5)
        for _ in range(seeds)
    ]
    summary = seed_summary(samples_E, resamples=100)
    per_seed = [evaluation_metrics(s, prefix="") for s in samples_E]
    assert summary.keys() == per_seed[0].keys()
    for name, stat in summary.items():
        values = [metrics[name] for metrics in per_seed]
        assert stat.per_seed == pytest.approx(values, abs=TOLERANCE)
        assert stat.mean == pytest.approx(sum(values) / len(values), abs=TOLERANCE)
        assert stat.interval.low <= stat.interval.high


def test_seed_summary_refuses_seeds_of_different_shapes() -> None:
    one = EvalSamples([[True]], [["a"]], [[False]], [[3]], [[1.0]])
    two = EvalSamples([[True, False]], [["a", None]], [[False, False]], [[3, 4]], [[1.0, 0.0]])
    with pytest.raises(ValueError, match="same problems and samples"):
        seed_summary([one, two])


@pytest.mark.parametrize(
    ("df", "quantile"),
    [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (9, 2.2622), (29, 2.0452)],
)
def test_student_t_quantile_matches_the_printed_table(df: int, quantile: float) -> None:
    assert student_t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-4)
    assert student_t_quantile(0.025, df) == pytest.approx(-quantile, abs=1e-4)


@given(st.integers(1, 60), st.floats(0.55, 0.999))
def test_student_t_quantile_inverts_a_numerical_integral_of_the_density(
    df: int, probability: float
) -> None:
    t = student_t_quantile(probability, df)
    grid = np.linspace(0.0, t, 20001)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(grid**2 / df))
    area = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(grid)))
    assert 0.5 + area == pytest.approx(probability, abs=1e-6)


@given(st.lists(st.floats(-10, 10), min_size=2, max_size=8))
def test_t_interval_is_the_mean_plus_minus_t_times_the_standard_error(values: list[float]) -> None:
    interval = t_interval(values)
    assert interval is not None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = student_t_quantile(0.975, len(values) - 1) * std / math.sqrt(len(values))
    assert interval.low == pytest.approx(mean - half, abs=1e-9)
    assert interval.high == pytest.approx(mean + half, abs=1e-9)
    assert t_interval(values[:1]) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("answers_PG", [["a"]], "answers_PG has shape"),
        ("tokens_PG", [[1]], "tokens_PG has shape"),
        ("reward_PG", [[float("nan"), 0.0]], "non-finite reward"),
        ("turns_PG", [[1, 1]], "given together"),
    ],
)
def test_eval_samples_refuse_inconsistent_arrays(field: str, value: object, message: str) -> None:
    fields = {
        "correct_PG": [[True, False]],
        "answers_PG": [["a", None]],
        "truncated_PG": [[False, True]],
        "tokens_PG": [[3, 4]],
        "reward_PG": [[1.0, 0.0]],
        field: value,
    }
    with pytest.raises(ValueError, match=message):
        EvalSamples(**fields)


@given(st.lists(st.floats(-5, 5), min_size=4, max_size=4))
def test_intervals_overlap_when_the_larger_low_is_below_the_smaller_high(ends: list[float]) -> None:
    first = Interval(min(ends[:2]), max(ends[:2]), 0.95, "t")
    second = Interval(min(ends[2:]), max(ends[2:]), 0.95, "t")
    expected = max(first.low, second.low) <= min(first.high, second.high)
    assert intervals_overlap(first, second) == expected == intervals_overlap(second, first)
