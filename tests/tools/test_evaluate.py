"""grpo eval: the run's task whole, seeds with intervals, a record that recomputes each figure."""

from __future__ import annotations

import io
import json
import math
from concurrent.futures import ThreadPoolExecutor
from itertools import combinations
from pathlib import Path

import attrs
import numpy as np
import pytest

from grpo.backends.local import LocalServiceClient
from grpo.cli import main
from grpo.core.records import Completion
from grpo.core.rewards import RewardInput
from grpo.rewards import load_rewards
from grpo.rewards.scores import score_completions
from grpo.tasks.data import columns_of, load_run_problems
from grpo.tools.evaluate import EvalProgress
from grpo.training.rollouts.evaluation import (
    Decoding,
    boxed_answer,
    code_answer,
    completion_samples,
    evaluate_policy,
)
from grpo.training.rollouts.problems import build_problems, tokenizer_max_len
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig
from tests.runs import quiet_train, tiny_config

TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run on the built-in model."""
    result = quiet_train(
        tiny_config(tmp_path_factory.mktemp("eval"), steps=1, eval_every=1, eval_limit=5)
    )
    return result.run_dir


# --- the record recomputes every printed figure ------------------------------------------


def plain_figures(record: dict) -> dict[str, list[float]]:
    """Every metric per seed, recomputed from the per-sample records by plain Python."""
    n = record["decoding"]["samples"]
    seeds = len(record["seeds"])
    figures: dict[str, list[float]] = {}

    def per_problem(name: str, value) -> None:
        figures.setdefault(name, [0.0] * seeds)
        for e in range(seeds):
            figures[name][e] += sum(value(p["samples"][e]) for p in record["problems"]) / len(
                record["problems"]
            )

    per_problem(f"avg@{n}", lambda s: sum(x["correct"] for x in s) / n)
    k = 1
    while k <= n:
        per_problem(
            f"pass@{k}",
            lambda s, k=k: (
                sum(any(x["correct"] for x in sub) for sub in combinations(s, k)) / math.comb(n, k)
            ),
        )
        k *= 2

    def vote(s: list[dict]) -> float:
        answers = [x["answer"] for x in s if x["answer"] is not None]
        if not answers:
            return 0.0
        top = max(answers.count(a) for a in answers)
        winner = next(a for a in answers if answers.count(a) == top)
        return float(next(x["correct"] for x in s if x["answer"] == winner))

    per_problem(f"cons@{n}", vote)
    per_problem("format_rate", lambda s: sum(x["answer"] is not None for x in s) / n)
    per_problem("truncation_rate", lambda s: sum(x["truncated"] for x in s) / n)
    per_problem("avg_gen_len", lambda s: sum(x["tokens"] for x in s) / n)
    per_problem("reward", lambda s: sum(x["reward"] for x in s) / n)
    if "turns" in record["problems"][0]["samples"][0][0]:
        per_problem("turns", lambda s: sum(x["turns"] for x in s) / n)
        per_problem("tool_calls", lambda s: sum(x["tool_calls"] for x in s) / n)
    return figures


def plain_interval(record: dict, name: str, value) -> tuple[float, float]:
    """The bootstrap interval as the record's `interval.how` states it."""
    how = record["interval"]
    seeds = len(record["seeds"])
    v = np.array(
        [sum(value(p["samples"][e]) for e in range(seeds)) / seeds for p in record["problems"]]
    )
    draws = np.random.default_rng(how["bootstrap_seed"]).integers(
        0, v.size, (how["resamples"], v.size)
    )
    low, high = np.quantile(v[draws].mean(axis=1), [0.025, 0.975])
    return float(low), float(high)


def test_eval_with_seeds_prints_every_metric_and_its_record_recomputes_each(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "e.json"
    argv = ["eval", "--run-dir", str(run_dir), "--limit", "6", "--samples", "8", "--seeds", "3"]
    assert main([*argv, "--temperature", "1.0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    names = [
        "avg@8",
        *(f"pass@{k}" for k in (1, 2, 4, 8)),
        "cons@8",
        "format_rate",
        "truncation_rate",
    ]
    lines = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.strip()}
    record = json.loads(out.read_text())
    figures = plain_figures(record)
    assert set(names) <= set(figures) == set(record["metrics"])
    for name, per_seed in figures.items():
        stat = record["metrics"][name]
        assert stat["per_seed"] == pytest.approx(per_seed, abs=TOLERANCE), name
        assert stat["mean"] == pytest.approx(sum(per_seed) / 3, abs=TOLERANCE), name
        mean, low, high = lines[name][:3]
        assert float(mean) == pytest.approx(stat["mean"], abs=5e-5), name
        assert f"{stat['low']:.4f}" in low and f"{stat['high']:.4f}" in high, name
    n = 8
    low, high = plain_interval(record, "avg@8", lambda s: sum(x["correct"] for x in s) / n)
    assert (record["metrics"]["avg@8"]["low"], record["metrics"]["avg@8"]["high"]) == (
        pytest.approx(low, abs=TOLERANCE),
        pytest.approx(high, abs=TOLERANCE),
    )
    assert record["weights"]["step"] == 1 and record["weights"]["path"]
    assert record["dataset"]["rows"] == 6 and record["dataset"]["split"] == "test"
    assert record["decoding"] == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 24, "samples": 8}
    assert record["seeds"] == [0, 1, 2] and record["backend"] == "local"
    assert record["task"]["rewards"] == ["grpo.rewards:boxed_match"]
    assert record["usage"]["completion_tokens"] > 0
    assert len(record["problems"][0]["samples"]) == 3
    assert len(record["problems"][0]["samples"][0]) == 8


def test_one_seed_reproduces_the_runs_own_evaluation(run_dir: Path) -> None:
    """The run's logged test row is this evaluation of its final weights, at its seed."""
    config = TrainConfig(**{**json.loads((run_dir / "config.json").read_text())})
    logged = read_metrics(run_dir)[-1]
    service = LocalServiceClient(root=str(run_dir / "backend"), seed=0)
    from grpo.training.run import run_files

    sampler = service.create_sampling_client(
        base_model=config.base_model, model_path=run_files.eval_weights_path(run_dir)
    )
    tokenizer = sampler.get_tokenizer()
    problems = build_problems(
        tokenizer,
        load_run_problems(config, "test", limit=config.eval_limit),
        fewshot=config.use_fewshot,
        max_tokens=config.max_tokens,
        max_len=tokenizer_max_len(tokenizer),
        split="test",
        columns=columns_of(config),
    )
    decoding = Decoding(temperature=config.temperature, top_p=1.0, max_tokens=config.max_tokens)
    with ThreadPoolExecutor(max_workers=4) as pool:
        result = evaluate_policy(
            sampler,
            problems,
            tokenizer,
            config,
            pool=pool,
            decoding=decoding,
            samples=1,
            seed=config.seed,
        )
    new, new_usage = result.metrics("test/"), result.usage
    assert {"test/avg@1", "test/cons@1", "test/format_rate", "test/truncation_rate"} <= set(new)
    for key, value in new.items():
        assert logged[key] == pytest.approx(value, abs=TOLERANCE), key
    assert new_usage.completion_tokens > 0


def test_math_verify_grades_and_a_code_reward_reads_code() -> None:
    completions = [
        Completion(tokens=np.array([1, 2]), logprobs=np.zeros(2), text=text, stop_reason=stop)
        for text, stop in (
            ("so \\boxed{\\frac{1}{2}}", "stop"),
            ("so \\boxed{0.5}", "stop"),
            ("no answer", "length"),
        )
    ]
    rewards = load_rewards(["grpo.rewards:math_verify", "grpo.rewards:overlong_penalty=0.5"])
    inputs = [
        ("", {"answer": "#### 1/2"}, RewardInput(0, "1/2", 2, 4, c.stop_reason, 1))
        for c in completions
    ]
    items = [(c.text, row, sample) for c, (_t, row, sample) in zip(completions, inputs)]
    scores = score_completions(rewards, items, [3])
    samples = completion_samples([completions], scores, rewards)
    assert samples.correct_PG.tolist() == [[True, True, False]]
    assert samples.answers_PG == (("\\frac{1}{2}", "0.5", None),)
    assert samples.truncated_PG.tolist() == [[False, False, True]]
    assert boxed_answer("\\boxed{1,000}") == "1000" and boxed_answer("\\boxed{ }") is None
    assert code_answer("x\n```python\nprint(1)\n```") == "print(1)" and code_answer("x") is None


def test_eval_with_math_verify_on_a_local_file_with_its_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"problem": f"What is {a} plus {a}?", "solution": f"\\boxed{{{2 * a}}}"} for a in range(4)
    ]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "math.json"
    argv = ["eval", "--dataset", str(data), "--prompt-column", "problem"]
    argv += ["--answer-column", "solution", "--gold-rule", r"regex:\\boxed\{(.*)\}"]
    argv += ["--reward", "grpo.rewards:math_verify", "--limit", "4", "--samples", "2"]
    assert main([*argv, "--temperature", "0.6", "--top-p", "0.95", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cons@2" in printed and "pass@2" in printed
    record = json.loads(out.read_text())
    assert record["task"] == {
        "rewards": ["grpo.rewards:math_verify"],
        "correct": "math_verify >= 1",
    }
    assert record["decoding"]["top_p"] == 0.95 and record["dataset"]["prompt_column"] == "problem"
    assert [p["gold"] for p in record["problems"]] == ["0", "2", "4", "6"]


def test_eval_of_the_calculator_env_reports_turns_and_tool_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "env.json"
    argv = ["eval", "--env", "grpo.envs:calculator_wordproblems", "--dataset", "wordproblems"]
    argv += ["--base-model", "grpo/tiny-qwen3-bpe-tools", "--max-tokens", "96", "--limit", "3"]
    assert main([*argv, "--samples", "2", "--temperature", "1.0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("avg@2", "pass@2", "cons@2", "turns", "tool_calls", "truncation_rate"):
        assert f"  {name} " in printed, printed
    record = json.loads(out.read_text())
    assert record["task"]["env"] == "grpo.envs:calculator_wordproblems"
    figures = plain_figures(record)
    for name, per_seed in figures.items():
        assert record["metrics"][name]["per_seed"] == pytest.approx(per_seed, abs=TOLERANCE)
    assert record["metrics"]["tool_calls"]["mean"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--out", "e.txt"], "--out e.txt must be a .json file"),
        (["--reward", "nope:fn"], "--reward 'nope:fn': no module 'nope'"),
        (["--env", "nope:make"], "nope"),
        (["--max-turns", "0"], "--max-turns must be >= 1, got 0"),
        (
            ["--env", "grpo.envs:calculator_wordproblems", "--reward", "grpo.rewards:math_verify"],
            "--reward would be ignored; drop --reward",
        ),
        (["--gold-rule", "bogus"], "--gold-rule 'bogus' is not"),
    ],
)
def test_bad_eval_flags_name_the_flag_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--limit", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    # one error line; before it at most the stage eval was in ("[grpo eval] checking the task")
    said = [line for line in err.strip().splitlines() if not line.startswith("[grpo eval] ")]
    assert len(said) == 1, err


def test_eval_refuses_an_existing_out_file_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "e.json"
    out.write_text("{}")
    assert main(["eval", "--limit", "2", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["eval", "--limit", "2", "--out", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["format"] == "grpo-eval/1"


def test_correctness_reads_the_first_rewards_first_component_and_failed_calls_are_wrong() -> None:
    completions = [
        Completion(tokens=np.array([1]), logprobs=np.zeros(1), text=t, stop_reason="stop")
        for t in ("\\boxed{4}", "\\boxed{5}")
    ]
    rewards = load_rewards(["grpo.rewards:boxed_format", "grpo.rewards:boxed_match"])
    items = [(c.text, {}, RewardInput(0, "4", 1, 4, "stop", 1)) for c in completions]
    samples = completion_samples([completions], score_completions(rewards, items, [2]), rewards)
    # boxed_format grades here: both answers are well formed, so both count as correct.
    assert samples.correct_PG.tolist() == [[True, True]]
    assert samples.reward_PG.tolist() == [[2.0, 1.0]]

    def broken(completion: str, row: dict) -> float:
        raise RuntimeError("down")

    failing = (
        attrs.evolve(rewards[1], name="broken", spec="x:broken", fn=broken, takes_sample=False),
        rewards[1],
    )
    scores = score_completions(failing, items, [2], on_error="zero")
    assert completion_samples([completions], scores, failing).correct_PG.tolist() == [
        [False, False]
    ]


def test_eval_shows_its_stages_and_each_tenth_of_the_requests_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["eval", "--limit", "10", "--seeds", "2"]) == 0
    captured = capsys.readouterr()
    shown = captured.err.splitlines()
    assert shown[:2] == [
        "[grpo eval] checking the task (its rewards or environment, its dataset)",
        "[grpo eval] loading grpo/tiny-qwen3-bpe (local backend)",
    ]
    # stderr is no terminal here: whole lines, one per tenth of the 10 problems x 2 seeds
    assert shown[2:] == [f"[grpo eval] {n}/20 problems" for n in range(2, 21, 2)]
    assert "\r" not in captured.err and "[grpo eval]" not in captured.out
    assert "  avg@1 " in captured.out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("total", "lines_at"), [(25, [3, 6, 9, 12, 15, 18, 21, 24, 25]), (3, [1, 2, 3])]
)
def test_eval_progress_is_a_bar_on_a_terminal_and_whole_lines_elsewhere(
    total: int, lines_at: list[int]
) -> None:
    log = io.StringIO()
    with EvalProgress(True, log).counting(total, "episode") as tick:
        for _ in range(total):
            tick()
    assert log.getvalue().splitlines() == [f"[grpo eval] {n}/{total} episodes" for n in lines_at]
    terminal = _Terminal()
    with EvalProgress(True, terminal).counting(total, "episode") as tick:
        for _ in range(total):
            tick()
    assert "\r" in terminal.getvalue() and f"{total}/{total}" in terminal.getvalue()
    quiet = io.StringIO()
    with EvalProgress(False, quiet).counting(total, "episode") as tick:
        tick()
    EvalProgress(False, quiet).stage("nothing")
    assert quiet.getvalue() == ""
