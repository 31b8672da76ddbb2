"""grpo.rewards: --reward specs load with clear errors, score with weights, fail loudly."""

from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.rewards import RewardInput
from grpo.rewards import RewardError, load_rewards, parse_reward_spec
from grpo.rewards.scores import score_completions
from grpo.training.settings.config import ConfigError, TrainConfig, check_user_inputs


def reward_file(tmp_path: Path, body: str, name: str = "my_rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def sample(index: int = 0, num_tokens: int = 5, stop_reason: str = "stop") -> RewardInput:
    return RewardInput(
        index=index,
        gold="7",
        num_tokens=num_tokens,
        max_tokens=24,
        stop_reason=stop_reason,
        overlong_buffer=6,
    )


def test_default_reward_is_boxed_match_with_weight_one() -> None:
    (reward,) = load_rewards(())
    assert (reward.name, reward.weight, reward.takes_sample) == ("boxed_match", 1.0, True)


@pytest.mark.parametrize(
    "spec, target, function, weight",
    [
        ("grpo.rewards:boxed_match", "grpo.rewards", "boxed_match", 1.0),
        ("my.py:short=0.2", "my.py", "short", 0.2),
        ("C:/x/my.py:short=-1", "C:/x/my.py", "short", -1.0),
        ("pkg.mod:fn=1e-3", "pkg.mod", "fn", 1e-3),
    ],
)
def test_spec_syntax(spec: str, target: str, function: str, weight: float) -> None:
    assert parse_reward_spec(spec) == (target, function, weight)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("grpo.rewards:boxed_match=heavy", "weight 'heavy' is not a number"),
        ("grpo.rewards:boxed_match=nan", "weight must be a finite number"),
        ("grpo.rewards", "must look like MODULE:FUNCTION"),
        (":boxed_match", "must look like MODULE:FUNCTION"),
        ("grpo.rewards:not-a-name", "is not a Python function name"),
        ("no_such_module_xyz:f", "no module 'no_such_module_xyz'"),
        ("missing_file.py:f", "file 'missing_file.py' not found"),
        ("grpo.rewards:no_such_fn", "has no 'no_such_fn'; its callables: .*boxed_match"),
        ("grpo.rewards:DEFAULT_REWARD", "is a str, not callable"),
        ("math:pi", "is a float, not callable"),
        ("math:atan2", None),  # a builtin without a signature inspect can read: called with 2
    ],
)
def test_loading_errors_name_the_spec_and_the_fix(spec: str, message: str | None) -> None:
    if message is None:
        load_rewards([spec])
        return
    with pytest.raises(ValueError, match=message):
        load_rewards([spec])
    with pytest.raises(ConfigError, match=message):
        check_user_inputs(TrainConfig(reward=(spec,)))


def test_file_rewards_load_and_wrong_signatures_are_rejected(tmp_path: Path) -> None:
    path = reward_file(
        tmp_path,
        """
        def two(completion, row):
            return 1.0

        def three(completion, row, sample):
            return 1.0

        def one(completion):
            return 1.0

        def four(completion, row, sample, extra):
            return 1.0

        broken = 3
        """,
    )
    two, three = load_rewards([f"{path}:two", f"{path}:three=0.5"])
    assert (two.takes_sample, three.takes_sample, three.weight) == (False, True, 0.5)
    for name in ("one", "four"):
        with pytest.raises(ConfigError, match=rf"{name}\(.*\) must accept \(completion, row\)"):
            check_user_inputs(TrainConfig(reward=(f"{path}:{name}",)))
    with pytest.raises(ConfigError, match="names 'two' twice"):
        check_user_inputs(TrainConfig(reward=(f"{path}:two", f"{path}:two=2")))


def test_a_file_that_fails_to_import_says_so(tmp_path: Path) -> None:
    path = reward_file(tmp_path, "import no_such_dependency_xyz\n", name="bad.py")
    with pytest.raises(ConfigError, match=r"importing .*bad.py failed: ModuleNotFoundError"):
        check_user_inputs(TrainConfig(reward=(f"{path}:f",)))


def _items(texts: list[str]) -> list[tuple[str, dict, RewardInput]]:
    return [
        (text, {"question": "q"}, sample(index=i, num_tokens=len(text)))
        for i, text in enumerate(texts)
    ]


def test_weighted_sum_and_per_component_metrics(tmp_path: Path) -> None:
    path = reward_file(
        tmp_path,
        """
        def short(completion, row):
            return 1.0 if len(completion) < 12 else 0.0

        def parts(completion, row, sample):
            return {"even": float(sample.index % 2 == 0), "len": float(len(completion))}
        """,
    )
    rewards = load_rewards(["grpo.rewards:boxed_match", f"{path}:short=0.2", f"{path}:parts=-0.5"])
    texts = ["\\boxed{7}", "\\boxed{8}", "a long one \\boxed{7}", "none"]
    scores = score_completions(rewards, _items(texts), [2, 2])
    match = np.array([1.0, 0.0, 1.0, 0.0])
    short = np.array([1.0, 1.0, 0.0, 1.0])
    even = np.array([1.0, 0.0, 1.0, 0.0])
    length = np.array([len(text) for text in texts], dtype=float)
    expected = match + 0.2 * short - 0.5 * even - 0.5 * length
    assert np.allclose(np.concatenate(scores.totals_P), expected)
    assert [group.size for group in scores.totals_P] == [2, 2]
    metrics = scores.metrics()
    assert metrics == {
        "reward/boxed_match": 0.5,
        "reward/short": 0.75,
        "reward/parts/even": 0.5,
        "reward/parts/len": float(length.mean()),
        "reward/errors": 0.0,
    }
    assert scores.components_P[1]["short"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise RuntimeError('sandbox down')", "raised RuntimeError: sandbox down"),
        ("return float('nan')", "returned nan for bad, not a finite number"),
        ("return 'yes'", "returned 'yes' \\(str\\) for bad, not a number"),
        ("return None", "returned None \\(NoneType\\) for bad, not a number"),
        ("return {'a': float('inf')}", "returned inf for bad/a"),
    ],
)
def test_a_failing_reward_names_the_row_and_the_completion(
    tmp_path: Path, body: str, message: str
) -> None:
    path = reward_file(
        tmp_path,
        f"""
        def bad(completion, row, sample):
            if sample.index == 2:
                {body}
            return 1.0
        """,
    )
    rewards = load_rewards([f"{path}:bad"])
    texts = ["one", "two", "the third completion", "four"]
    with pytest.raises(
        RewardError,
        match=message + ".* on row 2 for the completion "
        "'the third completion'.*--reward-errors zero",
    ):
        score_completions(rewards, _items(texts), [4])
    zeroed = score_completions(rewards, _items(texts), [4], on_error="zero")
    assert zeroed.errors == 1
    assert np.concatenate(zeroed.totals_P).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert zeroed.metrics()["reward/errors"] == 1.0


@given(
    texts=st.lists(st.text(max_size=20), min_size=1, max_size=12),
    workers=st.integers(1, 4),
)
def test_worker_pool_results_equal_serial(texts: list[str], workers: int) -> None:
    rewards = load_rewards(
        [
            "grpo.rewards:boxed_format",
            "grpo.rewards:overlong_penalty=0.5",
            "tests.test_rewards:slow",
        ]
    )
    sizes = [len(texts)]
    serial = score_completions(rewards, _items(texts), sizes)
    pooled = score_completions(rewards, _items(texts), sizes, workers=workers)
    assert np.concatenate(serial.totals_P).tobytes() == np.concatenate(pooled.totals_P).tobytes()
    assert serial.metrics() == pooled.metrics()


def slow(completion: str, row: dict, sample: RewardInput) -> float:
    """A reward whose calls finish out of order in a pool (later ones sleep less)."""
    time.sleep(max(0.0, 0.002 * (5 - sample.index)))
    return math.sin(len(completion) + sample.index)


def test_the_documented_example_reward_loads_and_scores() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "my_rewards.py"
    (reward,) = load_rewards([f"{example}:brief=0.5"])
    assert reward.weight == 0.5 and reward.takes_sample
    scores = score_completions([reward], _items(["a" * 10, "b" * 13, "c" * 30]), [3])
    assert np.concatenate(scores.totals_P).tolist() == [0.5, 0.25, 0.0]


def test_rewards_weights_and_prices_that_would_overflow_are_refused_where_they_enter(
    tmp_path: Path,
) -> None:
    from grpo.rewards import RewardFn, checked_values
    from grpo.training.settings.config import ConfigError, TrainConfig

    reward = RewardFn(spec="m:r", name="r", weight=1.0, fn=lambda c, r: 0.0, takes_sample=False)
    assert "beyond the bound of ±1e+12" in str(checked_values(reward, 1e308))
    assert checked_values(reward, -1e12) == {"r": -1e12}
    with pytest.raises(ValueError, match="within ±1e"):
        parse_reward_spec("grpo.rewards:boxed_match=1e308")
    with pytest.raises(ConfigError, match=r"--price-prompt must be <= 1e\+09, got 1e\+308"):
        TrainConfig(price_prompt=1e308)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ValueError, match=r"importing .*exits.py failed: SystemExit: 0"):
        load_rewards([f"{tmp_path / 'exits.py'}:r"])
