"""Token usage and cost: counts against what was really sent, the dry run's bound, prices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.usage import (
    USAGE_KINDS,
    Prices,
    TokenUsage,
    cost,
    planned_usage,
    sample_usage,
    usage_from_row,
    usage_metrics,
)
from grpo.training.recipes.grpo.plan import plan_usage, preflight
from grpo.training.recipes.grpo.run import dry_run
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import ConfigError, TrainConfig
from grpo.training.settings.prices import prices_for
from tests import runs as tiny_runs

TINY = {
    **tiny_runs.TINY,
    "steps": 3,
    "eval_every": 2,
    "eval_limit": 5,
    "save_every": 1,
    "num_substeps": 2,
}

counts = st.integers(min_value=0, max_value=10**9)
usages = st.builds(TokenUsage, counts, counts, counts, counts)
rates = st.floats(min_value=0, max_value=1e3, allow_nan=False)
price_lists = st.builds(Prices, st.just("CNY"), rates, rates, rates, rates)


# --- arithmetic ------------------------------------------------------------------------------


@given(usages, usages, price_lists)
def test_cost_is_linear_in_the_usage(first: TokenUsage, second: TokenUsage, prices: Prices) -> None:
    assert cost(first + second, prices) == pytest.approx(
        cost(first, prices) + cost(second, prices), rel=1e-12, abs=1e-9
    )


@pytest.mark.parametrize("kind", USAGE_KINDS)
def test_a_million_tokens_of_one_kind_cost_its_price(kind: str) -> None:
    prices = Prices("CNY", prompt=1.5, completion=2.5, train=3.5, forward=4.5)
    usage = TokenUsage(**{kind: 1_000_000})
    assert cost(usage, prices) == pytest.approx(prices.per_kind()[kind])
    assert cost(TokenUsage(**{kind: 2_000}), prices) == pytest.approx(
        prices.per_kind()[kind] * 2_000 / 1e6
    )


def test_usage_metrics_are_step_and_cumulative_and_read_back() -> None:
    step = TokenUsage(1, 2, 3, 4)
    total = TokenUsage(10, 20, 30, 40)
    prices = Prices("CNY", prompt=1.0, completion=2.0, train=3.0, forward=0.5)
    metrics = usage_metrics(step, total, prices)
    assert metrics["usage/completion_tokens"] == 2 and metrics["usage/cum_trained_tokens"] == 30
    assert metrics["usage/cum_tokens"] == 100
    assert metrics["cost/step"] == pytest.approx((1 + 4 + 9 + 2) / 1e6)
    assert metrics["cost/cum"] == pytest.approx((10 + 40 + 90 + 20) / 1e6)
    assert usage_from_row(metrics) == total
    assert "cost/cum" not in usage_metrics(step, total, None)


def test_sample_usage_takes_the_services_counts_and_counts_itself_only_when_missing() -> None:
    assert sample_usage(7, 9, 5, [2, 3]) == TokenUsage(prompt_tokens=7, completion_tokens=9)
    assert sample_usage(0, 0, 5, [2, 3]) == TokenUsage(prompt_tokens=5, completion_tokens=5)


# --- prices ------------------------------------------------------------------------------------


def _price_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "prices.toml"
    path.write_text(body)
    return str(path)


def test_price_file_and_flags(tmp_path: Path) -> None:
    file = _price_file(
        tmp_path,
        'currency = "CNY"\nsource = "test"\n[models."grpo/tiny-qwen3-bpe"]\n'
        "prompt = 1\ncompletion = 2\ntrain = 3\n",
    )
    prices = prices_for(TrainConfig(price_file=file))
    assert prices is not None
    assert (prices.prompt, prices.completion, prices.train, prices.forward) == (1, 2, 3, 3)
    assert prices.currency == "CNY" and "user-supplied" in prices.source and "test" in prices.source
    overridden = prices_for(TrainConfig(price_file=file, price_train=5.0, price_forward=0.5))
    assert overridden is not None and (overridden.train, overridden.forward) == (5, 0.5)
    assert prices_for(TrainConfig()) is None


@pytest.mark.parametrize(
    ("body", "flags", "message"),
    [
        ('currency = "CNY"\n[models.other]\nprompt = 1\n', {}, "no prices for model"),
        ('[models."grpo/tiny-qwen3-bpe"]\nprompt=1\ncompletion=1\ntrain=1\n', {}, "currency"),
        ('currency="X"\n[models."grpo/tiny-qwen3-bpe"]\nprompt=1\n', {}, "--price-completion"),
        ('currency="X"\n[models."grpo/tiny-qwen3-bpe"]\nprompt=-1\n', {}, ">= 0"),
        ('currency="X"\nprice=1\n', {}, "unknown key"),
    ],
)
def test_bad_prices_name_the_fix(tmp_path: Path, body: str, flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        prices_for(TrainConfig(price_file=_price_file(tmp_path, body), **flags))


def test_flag_prices_alone_need_every_kind_and_a_currency() -> None:
    with pytest.raises(ConfigError, match="--price-train"):
        prices_for(TrainConfig(price_prompt=1.0, price_completion=1.0, price_currency="CNY"))
    with pytest.raises(ConfigError, match="currency"):
        prices_for(TrainConfig(price_prompt=1.0, price_completion=1.0, price_train=1.0))
    with pytest.raises(ConfigError, match="--price-train must be >= 0"):
        TrainConfig(price_train=-1.0)


# --- counts against the calls the loop really made ------------------------------------------


@attrs.define
class Recorded:
    """Token counts recomputed from every call the loop made."""

    prompt: int = 0
    completion: int = 0
    reported_prompt: int = 0
    reported_completion: int = 0
    trained: int = 0
    forward: int = 0


class _RecordingSampler:
    def __init__(self, inner: Any, record: Recorded) -> None:
        self._inner, self._record = inner, record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, prompt: Any, num_samples: int = 1, **kwargs: Any) -> Any:
        response = self._inner.sample(prompt, num_samples, **kwargs).result()
        self._record.prompt += len(prompt.to_ints())
        self._record.completion += sum(len(sequence.tokens) for sequence in response.sequences)
        self._record.reported_prompt += response.input_tokens
        self._record.reported_completion += response.output_tokens
        return _Done(response)

    def compute_logprobs(self, prompt: Any) -> Any:
        self._record.prompt += len(prompt.to_ints())
        return self._inner.compute_logprobs(prompt)


class _RecordingTrainer:
    def __init__(self, inner: Any, record: Recorded) -> None:
        self._inner, self._record = inner, record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def forward_backward(self, data: list, *args: Any, **kwargs: Any) -> Any:
        self._record.trained += sum(len(datum.model_input.to_ints()) for datum in data)
        return self._inner.forward_backward(data, *args, **kwargs)

    def forward_backward_custom(self, data: list, *args: Any, **kwargs: Any) -> Any:
        self._record.trained += sum(len(datum.model_input.to_ints()) for datum in data)
        return self._inner.forward_backward_custom(data, *args, **kwargs)

    def forward(self, data: list, *args: Any, **kwargs: Any) -> Any:
        self._record.forward += sum(len(datum.model_input.to_ints()) for datum in data)
        return self._inner.forward(data, *args, **kwargs)

    def save_weights_and_get_sampling_client(self) -> Any:
        return _RecordingSampler(self._inner.save_weights_and_get_sampling_client(), self._record)


class _RecordingService:
    def __init__(self, inner: Any, record: Recorded) -> None:
        self._inner, self._record = inner, record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_sampling_client(self, *args: Any, **kwargs: Any) -> Any:
        return _RecordingSampler(self._inner.create_sampling_client(*args, **kwargs), self._record)

    def create_lora_training_client(self, *args: Any, **kwargs: Any) -> Any:
        return _RecordingTrainer(
            self._inner.create_lora_training_client(*args, **kwargs), self._record
        )


class _Done:
    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        return self._value


def _recorded_run(tmp_path: Path, name: str, **overrides: Any) -> tuple[Path, Recorded]:
    from grpo.backends.local import LocalServiceClient

    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / name), **overrides})
    record = Recorded()
    service = _RecordingService(LocalServiceClient(root=tmp_path / name / "backend"), record)
    tiny_runs.quiet_train(config, service_client=service)
    return tmp_path / name, record


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"kl_coef": 0.1, "custom_loss": True, "epochs": 2},
    ],
    ids=["default", "kl-custom-2-epochs"],
)
def test_usage_equals_the_tokens_really_sent_sampled_and_trained(
    tmp_path: Path, overrides: dict
) -> None:
    run_dir, record = _recorded_run(tmp_path, "run", **overrides)
    rows = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["usage"] == {
        "prompt_tokens": record.prompt,
        "completion_tokens": record.completion,
        "trained_tokens": record.trained,
        "forward_tokens": record.forward,
        "judge_prompt_tokens": 0,  # no judge reward in this run
        "judge_completion_tokens": 0,
    }
    # The service reports what the client counts (the local backend: exactly).
    assert record.reported_completion == record.completion
    assert record.trained > 0 and record.forward > 0
    for kind in USAGE_KINDS:
        steps = [row[f"usage/{kind}"] for row in rows]
        cumulative = [row[f"usage/cum_{kind}"] for row in rows]
        assert cumulative == [sum(steps[: index + 1]) for index in range(len(steps))]
    assert rows[-1]["usage/cum_forward_tokens"] == record.forward  # the final check included
    assert rows[-1]["usage/forward_tokens"] > 0


def test_dry_run_bound_holds_and_its_prompts_are_exact(tmp_path: Path) -> None:
    overrides = {"save_every": 2, "steps": 4}
    planned = []
    for kl_coef in (0.0, 0.1):
        config = TrainConfig(
            **{**TINY, **overrides, "kl_coef": kl_coef, "run_dir": str(tmp_path / f"plan{kl_coef}")}
        )
        lines = dry_run(config)
        assert lines[0].startswith("dry run of")
        assert not (tmp_path / f"plan{kl_coef}").exists(), "a dry run wrote into its run dir"
        from grpo.backends.local import LocalServiceClient

        pre = preflight(config, lambda: LocalServiceClient(root=tmp_path / "unused"))
        planned.append(plan_usage(pre))
        run_dir, record = _recorded_run(tmp_path, f"run{kl_coef}", **overrides, kl_coef=kl_coef)
        actual = TokenUsage(**json.loads((run_dir / "summary.json").read_text())["usage"])
        for kind in USAGE_KINDS:
            assert getattr(actual, kind) <= getattr(planned[-1], kind), (kind, actual, planned)
        if kl_coef == 0:
            assert actual.prompt_tokens == planned[-1].prompt_tokens
    assert planned[1].prompt_tokens > planned[0].prompt_tokens


def test_the_dynamic_sampling_bound_trains_the_b_longest_prompts_of_all_rounds() -> None:
    # B = 2 prompts of 10 and 20 tokens; the extra rounds sample prompts of 30 and 5.
    # G = 2, M = 4: prompts 10 + 20 + 30 + 5, completions 4 x 2 x 4, and the two groups that
    # can train are at most the 30- and 20-token ones: 2 x ((30 + 3) + (20 + 3)) positions.
    common = dict(
        group_size=2, max_tokens=4, epochs=1, num_evals=0, num_checkpoints=1, extra_forward=False
    )
    bound = planned_usage(
        [[10, 20]], [], with_reference=True, extra_prompt_lens_by_step=[[30, 5]], **common
    )
    reference = 2 * ((30 + 4) + (20 + 4))
    assert bound == TokenUsage(65 + reference, 32, 112, 112)
    assert planned_usage([[10, 20]], [], with_reference=False, **common) == TokenUsage(
        30, 16, 2 * (13 + 23), 2 * (13 + 23)
    )


DYNAMIC_REWARDS = """
def parity(completion, row):
    return float(len(completion) % 2)

def constant(completion, row):
    return 1.0
"""


@pytest.mark.parametrize("reward", ["parity", "constant"])
def test_dry_run_bound_holds_under_dynamic_sampling(tmp_path: Path, reward: str) -> None:
    from grpo.backends.local import LocalServiceClient
    from tests.test_tasks import reward_file

    overrides = dict(
        dynamic_sampling=True,
        max_sampling_rounds=3,
        batch_size=3,
        reward=(f"{reward_file(tmp_path, DYNAMIC_REWARDS)}:{reward}",),
    )
    config = TrainConfig(**{**TINY, **overrides, "run_dir": str(tmp_path / "plan")})
    assert any("every --max-sampling-rounds round sampled" in line for line in dry_run(config))
    planned = plan_usage(preflight(config, lambda: LocalServiceClient(root=tmp_path / "unused")))
    run_dir, _record = _recorded_run(tmp_path, "run", **overrides)
    rows = read_metrics(run_dir)
    rounds = [row["sampling/rounds"] for row in rows if "sampling/rounds" in row]
    actual = TokenUsage(**json.loads((run_dir / "summary.json").read_text())["usage"])
    for kind in USAGE_KINDS:
        assert getattr(actual, kind) <= getattr(planned, kind), (kind, actual, planned)
    if reward == "constant":  # no group can train: every step runs all its rounds
        assert rounds == [3.0] * 3 and actual.trained_tokens == 0
        assert actual.prompt_tokens == planned.prompt_tokens
    else:
        assert max(rounds) > 1 and actual.trained_tokens > 0, "test setup"


def test_dry_run_refuses_what_the_run_refuses(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exceeds the model's 2048 positions"):
        dry_run(TrainConfig(**{**TINY, "max_tokens": 2040, "run_dir": str(tmp_path / "long")}))
    assert not (tmp_path / "long").exists()


def test_reports_take_tokens_and_cost_from_the_summary_else_the_last_row(tmp_path: Path) -> None:
    from grpo.tools.experiments.report import runs_table
    from grpo.tools.experiments.stats import RunData, run_stats, run_usage

    row = {"step": 2, "reward": 0.5, "usage/cum_tokens": 900.0, "cost/cum": 0.25}
    running = RunData(tmp_path / "a", {"price_currency": "CNY"}, [row], None)
    assert run_usage(running) == {"tokens": 900.0, "cost": 0.25, "currency": "CNY"}
    usage = {
        "prompt_tokens": 500,
        "completion_tokens": 300,
        "trained_tokens": 150,
        "forward_tokens": 50,
    }
    summary = {"usage": usage, "cost": {"total": 0.5, "currency": "USD"}}
    finished = RunData(tmp_path / "b", {}, [row], summary)
    assert run_usage(finished) == {"tokens": 1000, "cost": 0.5, "currency": "USD"}
    unpriced = RunData(tmp_path / "c", {}, [{"step": 1, "reward": 0.0}], None)
    assert run_usage(unpriced) == {"tokens": None, "cost": None, "currency": None}
    table = "\n".join(
        runs_table([run_stats(run, label="x", seed=0, last_steps=1) for run in (finished,)])
    )
    assert "| 1,000 | 0.5000 USD |" in table


def test_dry_run_of_a_resume_plans_the_remaining_steps_and_touches_nothing(
    tmp_path: Path,
) -> None:
    run_dir, _record = _recorded_run(tmp_path, "run", steps=2, eval_every=0)
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    config = TrainConfig(**{**TINY, "steps": 4, "eval_every": 0, "run_dir": str(run_dir)})
    lines = dry_run(config, resume=True)
    assert any("plan: steps 2..4" in line for line in lines), lines
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before
