"""grpo.rewards:math_verify: a table of LaTeX answer pairs, pooled = serial, timeouts score 0."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpo.core.rewards import RewardInput
from grpo.rewards import load_rewards, math_verify
from grpo.rewards.math_grading import (
    GradingTimeout,
    math_gold,
    run_pooled,
    verify_answer,
    verify_pooled,
)
from grpo.rewards.scores import score_completions

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


def test_a_math_verify_run_evaluates_with_math_verify_on_latex_golds(tmp_path: Path) -> None:
    """A run trained on --reward grpo.rewards:math_verify also evaluates with it: a gold of
    \\frac{2n}{2} for n scores the model's boxed n, which the strict boxed match calls wrong."""
    from pytrio.types import SamplingParams

    from grpo.backends.local import LocalServiceClient
    from grpo.core.rewards import grade
    from grpo.tasks.data import load_run_problems
    from grpo.training.rollouts.problems import build_problems, tokenizer_max_len
    from grpo.training.rollouts.sampling import Sampling
    from grpo.training.run import run_files
    from grpo.training.run.seeds import Purpose, sampling_seed
    from grpo.training.settings.config import TrainConfig
    from tests.runs import quiet_train, tiny_config

    data = tmp_path / "latex"
    data.mkdir()
    for split in ("train", "test"):
        rows = load_run_problems(TrainConfig(), split, limit=40)
        lines = []
        for row in rows:
            value = int(row["answer"].rsplit("####", 1)[1])
            lines.append(
                json.dumps(
                    {"question": row["question"], "answer": f"#### \\frac{{{2 * value}}}{{2}}"}
                )
            )
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    config = tiny_config(
        tmp_path,
        "mv",
        dataset=str(data),
        reward=("grpo.rewards:math_verify",),
        steps=1,
        eval_every=1,
        eval_limit=40,
    )
    result = quiet_train(config)
    final = run_files.read_metrics(result.run_dir)[-1]
    assert final["test/reward"] > 0.2 and final["test/reward"] == final["test/math_verify"]
    # The same evaluation samples (same seeds, final weights), graded by math-verify directly.
    service = LocalServiceClient(root=str(result.run_dir / "backend"), seed=config.seed)
    sampler = service.create_sampling_client(
        base_model=config.base_model, model_path=run_files.eval_weights_path(result.run_dir)
    )
    tokenizer = sampler.get_tokenizer()
    test_rows = load_run_problems(config, "test", limit=40)
    problems = build_problems(
        tokenizer,
        test_rows,
        fewshot=config.use_fewshot,
        max_tokens=config.max_tokens,
        max_len=tokenizer_max_len(tokenizer),
        split="test",
    )

    def params(index: int) -> SamplingParams:
        seed = sampling_seed(config.seed, 0, index, purpose=Purpose.EVAL)
        return SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, top_p=1.0, seed=seed
        )

    with ThreadPoolExecutor(4) as pool:
        completions_P = (
            Sampling(pool, tokenizer, 1, print)
            .submit(sampler, problems, params, num_samples=1)
            .result()
        )
    scores, strict = [], []
    for problem, (completion,) in zip(problems, completions_P, strict=True):
        sample = RewardInput(
            problem.index, problem.gold, int(completion.tokens.size), 24, "stop", 0
        )
        scores.append(math_verify(completion.text, problem.row, sample))
        strict.append(grade(completion.text, problem.gold))
    assert final["test/reward"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
    assert sum(strict) == 0  # the boxed match cannot read \frac{2n}{2} as n


def test_calls_queued_behind_slow_ones_are_timed_from_their_start_not_their_submission() -> None:
    # Three times as many threads as pool workers, each call half the timeout: timed from
    # submission, the third wave waited a whole timeout and scored 0 (GradingTimeout).
    from grpo.rewards.math_grading import POOL_WORKERS

    run_pooled(time.sleep, 0, timeout_s=30)  # the pool warm, so no call waits on a start
    with ThreadPoolExecutor(max_workers=3 * POOL_WORKERS) as threads:
        calls = [
            threads.submit(run_pooled, time.sleep, 0.6, timeout_s=1.2)
            for _ in range(3 * POOL_WORKERS)
        ]
        assert [call.result() for call in calls] == [None] * len(calls)
