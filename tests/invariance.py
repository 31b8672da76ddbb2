"""What "the same result" means across batch shapes, thread counts, processes and CPU paths.

The local backend's guarantee (``docs/DESIGN.md``, "Reproducibility"): a seeded request
samples the same tokens, stop reasons and texts whatever shares its batch, on any thread
count and any CPU path, and log-probs equal to ``LOGPROB_ATOL``. Bit-for-bit equality holds
only where the BLAS computes each row of a float32 matmul independently of the row count
(padding every call to ``ROW_MULTIPLE`` rows buys it on some CPUs, not on all: MKL on an
Intel AVX-512 CPU reorders the reduction for another row count), so no test asserts it.

Tests that compare floats produced under different batch compositions, thread counts,
processes or CPU paths use these helpers; a comparison inside one batch, or of bits copied
unchanged (saved weights, a resumed file), stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# float32 has a relative rounding unit of 6e-8; a log-prob of the ~1M-parameter model is a
# sum of a few hundred such roundings over 4 layers, so another reduction order moves it by
# ~1e-7 (measured: 1.6e-7 on an Intel AVX-512 CPU; at most 3.0e-7 over the sampler tests
# with row-count-dependent matmuls, `any_blas` in tests/backends/test_local_sampling.py).
# 1e-5 leaves room for longer sequences and still fails a row that reads another row's
# cache or position (differences of 1e-2 and more).
LOGPROB_ATOL = 1e-5

# Metrics of short runs whose sampled tokens agree but whose log-probs differ as above: the
# loss, ratios and KL move by the same relative amount through a few Adam steps (measured
# at most ~1e-6 relative); a wrong optimizer state, seed or datum after a resume moves them
# by 1e-3 or more. Metrics near 0 are differences of log-probs (`ratio/max_abs_log`, the KL)
# or sums that cancel (a loss over centred advantages: sum_t ratio_t * A_t over ~1000
# tokens), so their error is absolute: the log-probs' error times sum_t |A_t|, up to ~10x
# LOGPROB_ATOL. A resumed run whose concurrent sampling requests shared a batch differently
# (timing, under load) logged ratio/max_abs_log 3.6e-6 against 2.4e-6, and losses of 2.0e-6
# against 4.2e-7 and of 9.4e-6 against -2.9e-6, on an Intel AVX-512 CPU. Hence 1e-4, still
# 10x under what a wrong resume moves.
METRIC_RTOL = 1e-4
METRIC_ATOL = 1e-4


def assert_close_data(
    actual: Any,
    expected: Any,
    rtol: float = METRIC_RTOL,
    atol: float = METRIC_ATOL,
    where: str = "",
) -> None:
    """Nested dicts/lists equal: floats to rtol/atol (NaN equals NaN), everything else exactly."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where or 'value'}: {actual!r} is not a mapping"
        assert sorted(actual) == sorted(expected), f"{where or 'value'}: keys differ"
        for key in expected:
            assert_close_data(actual[key], expected[key], rtol, atol, f"{where}[{key!r}]")
    elif isinstance(expected, Sequence) and not isinstance(expected, str | bytes):
        assert isinstance(actual, Sequence) and not isinstance(actual, str | bytes), where
        assert len(actual) == len(expected), (
            f"{where or 'value'}: {len(actual)} items, expected {len(expected)}"
        )
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_close_data(left, right, rtol, atol, f"{where}[{index}]")
    elif isinstance(expected, float) and not isinstance(actual, bool):
        assert isinstance(actual, int | float), f"{where}: {actual!r} is not a number"
        same = (math.isnan(actual) and math.isnan(expected)) or math.isclose(
            actual, expected, rel_tol=rtol, abs_tol=atol
        )
        assert same, f"{where}: {actual!r} != {expected!r} (rtol {rtol}, atol {atol})"
    else:
        assert actual == expected, f"{where or 'value'}: {actual!r} != {expected!r}"


def assert_same_rows(
    actual: list[dict[str, Any]], expected: list[dict[str, Any]], what: str = "rows"
) -> None:
    """Metrics rows of two runs agree: integers and strings exactly, floats to METRIC_RTOL."""
    assert_close_data(actual, expected, METRIC_RTOL, METRIC_ATOL, what)


def assert_same_rollouts(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Logged rollouts of two runs agree: texts and tokens exactly, log-probs to LOGPROB_ATOL."""
    assert_close_data(actual, expected, METRIC_RTOL, LOGPROB_ATOL, "rollouts")


def _plain(value: Any) -> Any:
    """A pytrio response (a pydantic model) or a list of them as plain data."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def assert_same_samples(actual: Any, expected: Any) -> None:
    """Sampling results agree: tokens, texts and stop reasons exactly, log-probs to LOGPROB_ATOL."""
    assert_close_data(_plain(actual), _plain(expected), 0.0, LOGPROB_ATOL, "sample")
