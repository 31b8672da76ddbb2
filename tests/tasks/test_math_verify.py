"""grpo.rewards:math_verify: a table of LaTeX answer pairs, pooled = serial, timeouts score 0."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo.core.rewards import RewardInput
from grpo.rewards import load_rewards, math_verify, score_completions
from grpo.tasks.math_grading import (
    GradingTimeout,
    math_gold,
    run_pooled,
    verify_answer,
    verify_pooled,
)

# (gold, answer, equivalent): each answer as a model would box it.
PAIRS = [
    (r"\frac{1}{2}", "0.5", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", True),
    (r"(3,\frac{\pi}{2})", r"(3, \pi/2)", True),
    ("5", "x=5", True),
    ("x=5", "5", True),
    ("1000", "1,000", True),
    (r"\frac{3}{4}", r"\dfrac{3}{4}", True),
    (r"\frac{3}{4}", r"\tfrac34", True),
    ("0.5", r"50\%", True),
    ("50", r"50\%", True),
    ("-3", "-3.0", True),
    ("-7", r"-\frac{14}{2}", True),
    ("[1,3)", "[1, 3)", True),
    (r"(-\infty, 2]", r"(-\infty,2]", True),
    (r"\{1,2\}", r"\{2,1\}", True),
    ("(x+1)^2", "x^2+2x+1", True),
    ("a+b", "b+a", True),
    ("10", r"10^{\circ}", True),
    ("5", r"\$5", True),
    (r"\text{(B)}", "B", True),
    (r"\infty", r"\infty", True),
    ("-3", "3", False),
    ("2", "3", False),
    ("[1,3)", "(1,3)", False),
    ("(1,2)", "(2,1)", False),
    (r"\frac{1}{3}", "0.33", False),
    (r"\pi", "3.14159", False),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("12", "1,2", False),
    (r"2\sqrt{2}", r"\sqrt{2}", False),
    ("x=5", "x=6", False),
]


def sample(gold: str) -> RewardInput:
    return RewardInput(
        index=0, gold=gold, num_tokens=10, max_tokens=64, stop_reason="stop", overlong_buffer=4
    )


def boxed(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


@pytest.mark.parametrize("gold, answer, equivalent", PAIRS)
def test_math_verify_grades_the_table(gold: str, answer: str, equivalent: bool) -> None:
    assert math_verify(boxed(answer), {}, sample(gold)) == float(equivalent)


def test_pooled_results_equal_serial_in_process_ones() -> None:
    serial = [verify_answer(answer, gold) for gold, answer, _ in PAIRS]
    pooled = [verify_pooled(answer, gold) for gold, answer, _ in PAIRS]
    assert pooled == serial == [float(equivalent) for _, _, equivalent in PAIRS]


def test_reward_threads_score_what_serial_calls_score() -> None:
    (reward,) = load_rewards(["grpo.rewards:math_verify"])
    items = [(boxed(answer), {}, sample(gold)) for gold, answer, _ in PAIRS]
    serial = score_completions([reward], items, [len(items)], workers=0)
    threaded = score_completions([reward], items, [len(items)], workers=4)
    assert serial.totals_P[0].tolist() == threaded.totals_P[0].tolist()
    assert serial.totals_P[0].tolist() == [float(equivalent) for _, _, equivalent in PAIRS]


def test_the_gold_of_a_math_style_row_is_its_solutions_last_boxed_answer() -> None:
    row = {"problem": "Halve 1.", "solution": r"First \boxed{7}, no: $\boxed{\frac{1}{2}}$."}
    assert math_gold(row, "ignored") == r"\frac{1}{2}"
    assert math_gold({"answer": "#### 4"}, "4") == "4"
    assert math_verify(boxed("0.5"), row, sample("ignored")) == 1.0
    assert math_verify("no boxed answer: 0.5", row, sample("ignored")) == 0.0
    assert math_verify(boxed(" "), row, sample("ignored")) == 0.0


def test_a_call_past_the_timeout_raises_recycles_the_pool_and_the_next_call_works() -> None:
    start = time.monotonic()
    with pytest.raises(GradingTimeout, match="ran past 0.5 s"):
        run_pooled(time.sleep, 60, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert verify_pooled("0.5", r"\frac{1}{2}") == 1.0


def test_calls_from_other_threads_survive_one_threads_timeout() -> None:
    def slow_then_grade(pair: tuple[str, str, bool]) -> float:
        # In flight on the pool when the main thread's call times out and recycles it.
        assert run_pooled(time.sleep, 0.3) is None
        gold, answer, _ = pair
        return verify_pooled(answer, gold)

    with ThreadPoolExecutor(max_workers=3) as threads:
        graded = threads.map(slow_then_grade, PAIRS[:9])
        with pytest.raises(GradingTimeout):
            run_pooled(time.sleep, 60, timeout_s=0.5)
        assert list(graded) == [float(equivalent) for _, _, equivalent in PAIRS[:9]]


def test_calls_queued_behind_slow_ones_are_timed_from_their_start_not_their_submission() -> None:
    # Three times as many threads as pool workers, each call half the timeout: timed from
    # submission, the third wave waited a whole timeout and scored 0 (GradingTimeout).
    from grpo.tasks.math_grading import POOL_WORKERS

    run_pooled(time.sleep, 0, timeout_s=30)  # the pool warm, so no call waits on a start
    with ThreadPoolExecutor(max_workers=3 * POOL_WORKERS) as threads:
        calls = [
            threads.submit(run_pooled, time.sleep, 0.6, timeout_s=1.2)
            for _ in range(3 * POOL_WORKERS)
        ]
        assert [call.result() for call in calls] == [None] * len(calls)
