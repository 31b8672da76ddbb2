"""Evaluation metrics of n graded samples per problem, and their intervals.

docs/FORMULAS.md, "Evaluation metrics". Axes (docs/DESIGN.md): ``_P`` problems, ``_G`` the n
samples of one problem, ``_E`` seeds (repeated evaluations, or a configuration's runs).

- `EvalSamples`: the graded samples of one evaluation (one seed), an immutable record.
- `powers_of_two`: the k of pass@k, 1, 2, 4, ... <= n.
- `avg_at_n`, `pass_at_k`, `majority_index`, `cons_at_n`: the per-problem formulas.
- `problem_values`: every metric's per-problem value; `evaluation_metrics`: their means,
  named as logged (``test/avg@8``, ``test/pass@4``, ``test/cons@8``, ``test/format_rate`` ...).
- `bootstrap_interval`: the percentile bootstrap over problems of a mean over seeds.
- `seed_summary`: every metric of E seeds, its mean, its bootstrap interval, its per-seed values.
- `student_t_quantile`, `t_interval`: the t interval over training runs (compare, sweep);
  `intervals_overlap`: whether two intervals leave the two values unseparated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "LEVEL",
    "EvalSamples",
    "Interval",
    "MetricSummary",
    "avg_at_n",
    "bootstrap_interval",
    "cons_at_n",
    "evaluation_metrics",
    "intervals_overlap",
    "majority_index",
    "pass_at_k",
    "powers_of_two",
    "problem_values",
    "seed_summary",
    "student_t_quantile",
    "t_interval",
]

LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000


def _frozen(dtype: type) -> object:
    def convert(value: object) -> np.ndarray:
        array = np.array(value, dtype=dtype)
        array.setflags(write=False)
        return array

    return convert


def _answers(value: object) -> tuple[tuple[str | None, ...], ...]:
    return tuple(tuple(None if a is None else str(a) for a in row) for row in value)  # type: ignore[attr-defined]


@attrs.frozen
class EvalSamples:
    """n graded samples of each of P problems (one seed): arrays of shape (P, n).

    ``correct_PG`` c ∈ {0, 1}; ``answers_PG`` the extracted answer or None; ``truncated_PG``
    stopped by max_tokens; ``tokens_PG`` sampled tokens; ``reward_PG`` the reward R;
    ``turns_PG`` and ``tool_calls_PG`` only for episodes (--env), else None.
    """

    correct_PG: np.ndarray = attrs.field(converter=_frozen(np.bool_))
    answers_PG: tuple[tuple[str | None, ...], ...] = attrs.field(converter=_answers)
    truncated_PG: np.ndarray = attrs.field(converter=_frozen(np.bool_))
    tokens_PG: np.ndarray = attrs.field(converter=_frozen(np.int64))
    reward_PG: np.ndarray = attrs.field(converter=_frozen(np.float64))
    turns_PG: np.ndarray | None = attrs.field(
        default=None, converter=attrs.converters.optional(_frozen(np.int64))
    )
    tool_calls_PG: np.ndarray | None = attrs.field(
        default=None, converter=attrs.converters.optional(_frozen(np.int64))
    )

    def __attrs_post_init__(self) -> None:
        shape = self.correct_PG.shape
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            raise ValueError(
                f"correct_PG must have shape (problems >= 1, samples >= 1), got {shape}"
            )
        answer_shape = (len(self.answers_PG), *{len(row) for row in self.answers_PG})
        if answer_shape != shape:
            raise ValueError(f"answers_PG has shape {answer_shape} but correct_PG has {shape}")
        for name in ("truncated_PG", "tokens_PG", "reward_PG", "turns_PG", "tool_calls_PG"):
            array = getattr(self, name)
            if array is not None and array.shape != shape:
                raise ValueError(f"{name} has shape {array.shape} but correct_PG has {shape}")
        if (self.turns_PG is None) != (self.tool_calls_PG is None):
            raise ValueError("turns_PG and tool_calls_PG are given together (episodes) or not")
        if not np.all(np.isfinite(self.reward_PG)):
            raise ValueError("reward_PG holds a non-finite reward")

    @property
    def num_problems(self) -> int:
        """P."""
        return int(self.correct_PG.shape[0])

    @property
    def num_samples(self) -> int:
        """n, the samples of each problem."""
        return int(self.correct_PG.shape[1])


def powers_of_two(n: int) -> tuple[int, ...]:
    """The k of pass@k: 1, 2, 4, ... <= n."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return tuple(2**i for i in range(n.bit_length()))


def avg_at_n(correct_PG: npt.ArrayLike) -> np.ndarray:
    """avg@n of each problem: c_p / n, the mean correctness of its n samples."""
    return np.asarray(correct_PG, dtype=np.float64).mean(axis=1)


def pass_at_k(correct_PG: npt.ArrayLike, k: int) -> np.ndarray:
    """pass@k of each problem: 1 − C(n − c_p, k) / C(n, k), and 1 when n − c_p < k."""
    counts_P = np.asarray(correct_PG, dtype=np.int64).sum(axis=1)
    n = int(np.shape(correct_PG)[1])
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n}, got k = {k}")
    # One exact value per possible count c = 0..n, looked up by each problem's count.
    by_count = np.array(
        [1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0 for c in range(n + 1)]
    )
    return by_count[counts_P]


def majority_index(answers_G: Sequence[str | None]) -> int | None:
    """The first sample g whose answer is the most frequent one (ties: the answer given first).

    None when no sample has an answer.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, answer in enumerate(answers_G):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, index)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[answer] for answer, count in counts.items() if count == best)


def cons_at_n(correct_PG: npt.ArrayLike, answers_PG: Sequence[Sequence[str | None]]) -> np.ndarray:
    """cons@n of each problem: c of the first sample with the majority answer (0 if none)."""
    correct = np.asarray(correct_PG, dtype=np.float64)
    values = np.zeros(correct.shape[0])
    for p, answers_G in enumerate(answers_PG):
        index = majority_index(answers_G)
        if index is not None:
            values[p] = correct[p, index]
    return values


def problem_values(samples: EvalSamples) -> dict[str, np.ndarray]:
    """Every metric's per-problem value (its mean over problems is the metric).

    ``avg@n``, ``pass@k`` (k = 1, 2, 4, ... <= n), ``cons@n``, ``format_rate``,
    ``truncation_rate``, ``avg_gen_len``, ``reward``; ``turns``, ``tool_calls`` for episodes.
    """
    n = samples.num_samples
    answered_PG = np.array([[a is not None for a in row] for row in samples.answers_PG])
    values = {f"avg@{n}": avg_at_n(samples.correct_PG)}
    values.update({f"pass@{k}": pass_at_k(samples.correct_PG, k) for k in powers_of_two(n)})
    values[f"cons@{n}"] = cons_at_n(samples.correct_PG, samples.answers_PG)
    values["format_rate"] = answered_PG.mean(axis=1)
    values["truncation_rate"] = samples.truncated_PG.mean(axis=1)
    values["avg_gen_len"] = samples.tokens_PG.mean(axis=1)
    values["reward"] = samples.reward_PG.mean(axis=1)
    if samples.turns_PG is not None and samples.tool_calls_PG is not None:
        values["turns"] = samples.turns_PG.mean(axis=1)
        values["tool_calls"] = samples.tool_calls_PG.mean(axis=1)
    return values


def evaluation_metrics(samples: EvalSamples, prefix: str = "test/") -> dict[str, float]:
    """Each metric = mean over problems of its per-problem value, keyed ``prefix + name``."""
    return {
        f"{prefix}{name}": float(values_P.mean())
        for name, values_P in problem_values(samples).items()
    }


@attrs.frozen
class Interval:
    """A confidence interval [low, high] at `level`, and how it was computed."""

    low: float
    high: float
    level: float
    method: str


def bootstrap_interval(
    values_EP: npt.ArrayLike,
    *,
    level: float = LEVEL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap over problems of m = mean_p (mean_e v_pe).

    Resample b draws P problems with replacement (``default_rng(seed).integers(0, P, (B, P))``),
    each with all its seeds; the interval is the (1 ± level)/2 quantiles of m_1..m_B.
    """
    values = np.asarray(values_EP, dtype=np.float64)
    if values.ndim != 2 or values.size == 0:
        raise ValueError(
            f"values_EP must have shape (seeds >= 1, problems >= 1), got {values.shape}"
        )
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples >= 1, got {level}, {resamples}")
    per_problem_P = values.mean(axis=0)
    indices_BP = np.random.default_rng(seed).integers(
        0, per_problem_P.size, size=(resamples, per_problem_P.size)
    )
    means_B = per_problem_P[indices_BP].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means_B, [tail, 1.0 - tail])
    return Interval(
        low=float(low),
        high=float(high),
        level=level,
        method=f"percentile bootstrap over problems, {resamples} resamples, seed {seed}",
    )


@attrs.frozen
class MetricSummary:
    """A metric over E seeds: the mean of its per-seed values, its interval, those values."""

    mean: float
    interval: Interval
    per_seed: tuple[float, ...]


def seed_summary(
    samples_E: Sequence[EvalSamples],
    *,
    level: float = LEVEL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = 0,
) -> dict[str, MetricSummary]:
    """Every metric of E evaluations of the same problems: mean over seeds, bootstrap interval."""
    if not samples_E:
        raise ValueError("seed_summary needs at least one evaluation")
    shapes = {samples.correct_PG.shape for samples in samples_E}
    if len(shapes) != 1:
        raise ValueError(
            f"every seed must grade the same problems and samples, got shapes {shapes}"
        )
    values_E = [problem_values(samples) for samples in samples_E]
    summary = {}
    for name in values_E[0]:
        values_EP = np.stack([values[name] for values in values_E])
        summary[name] = MetricSummary(
            mean=float(values_EP.mean()),
            interval=bootstrap_interval(
                values_EP, level=level, resamples=resamples, seed=bootstrap_seed
            ),
            per_seed=tuple(float(v) for v in values_EP.mean(axis=1)),
        )
    return summary


def _t_two_sided(t: float, df: int) -> float:
    """A(t | ν) = P(|T| <= t) for integer ν (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        term, series = math.cos(theta), 0.0
        if df > 1:
            series = term
            for j in range(3, df - 1, 2):
                term *= cos2 * (j - 1) / j
                series += term
        return (2.0 / math.pi) * (theta + sin * series)
    term, series = 1.0, 1.0
    for j in range(2, df - 1, 2):
        term *= cos2 * (j - 1) / j
        series += term
    return sin * series


def student_t_quantile(probability: float, df: int) -> float:
    """t_{q, ν}: the q-quantile of Student's t with integer ν >= 1 degrees of freedom."""
    if not 0 < probability < 1 or df < 1:
        raise ValueError(f"need 0 < probability < 1 and df >= 1, got {probability}, {df}")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, df)
    target = 2.0 * probability - 1.0
    low, high = 0.0, 1.0
    while _t_two_sided(high, df) < target:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if _t_two_sided(middle, df) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


def t_interval(values_E: Sequence[float], level: float = LEVEL) -> Interval | None:
    """x̄ ± t_{(1 + level)/2, E − 1} · s / √E over E independent runs; None for E < 2."""
    values = np.asarray(values_E, dtype=np.float64)
    if values.size < 2:
        return None
    mean, std = float(values.mean()), float(values.std(ddof=1))
    half = student_t_quantile((1.0 + level) / 2.0, values.size - 1) * std / math.sqrt(values.size)
    return Interval(
        low=mean - half, high=mean + half, level=level, method=f"t over {values.size} seeds"
    )


def intervals_overlap(first: Interval, second: Interval) -> bool:
    """[l1, h1] and [l2, h2] share a point: l1 <= h2 and l2 <= h1 (not separated)."""
    return first.low <= second.high and second.low <= first.high
