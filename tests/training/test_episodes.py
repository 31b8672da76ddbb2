"""Multi-turn rollouts (grpo.training.rollouts.episodes): the token stream, its limits, and
--env runs."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from pytrio.types import SampleResponse, SampleSequence

from grpo.backends.local.tiny import build_tokenizer
from grpo.envs import StepResult, Task, calculator_wordproblems
from grpo.envs.base import EnvError
from grpo.envs.tools import format_tool_call
from grpo.envs.wordproblems import TOOL_SYSTEM_PROMPT
from grpo.training.rollouts.episodes import EpisodeLimits, TemplateError, play_episode, render
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import ConfigError
from tests.invariance import assert_same_rollouts, assert_same_rows
from tests.runs import comparable, embedded_service, quiet_train, tiny_config

TOKENIZER = build_tokenizer()
END = TOKENIZER.eos_token_id
TASK = Task(
    question="Ann has 9 apples and buys 4 more. How many now?",
    gold="13",
    messages=({"role": "user", "content": "Ann has 9 apples and buys 4 more. How many now?"},),
)
LIMITS = EpisodeLimits(max_turns=4, max_tokens=200, max_len=2048, temperature=1.0)


def _bytes_tokens(text: str) -> list[int]:
    """A non-canonical tokenization of ``text``: one token per character (ASCII text)."""
    byte_level = {" ": "Ġ", "\n": "Ċ"}
    return [TOKENIZER.convert_tokens_to_ids(byte_level.get(c, c)) for c in text]


class ScriptedSampler:
    """A sampler that answers the n-th request with the n-th scripted token list."""

    def __init__(self, script: list[list[int]], stop: str = "stop") -> None:
        self.script, self.stop, self.prompts = list(script), stop, []

    def sample(self, *, prompt, num_samples, sampling_params, return_text) -> Future:
        self.prompts.append(prompt.to_ints())
        tokens = self.script[len(self.prompts) - 1][: sampling_params.max_tokens]
        future: Future = Future()
        future.set_result(
            SampleResponse(
                sequences=[
                    SampleSequence(
                        stop_reason=self.stop if tokens[-1] != END else "stop",
                        tokens=tokens,
                        logprobs=[-0.5] * len(tokens),
                    )
                ]
            )
        )
        return future


def _play(env: Any, sampler: ScriptedSampler, limits: EpisodeLimits = LIMITS, tokenizer=TOKENIZER):
    return play_episode(
        sampler, env, tokenizer, limits, lambda turn: turn, max_retries=0, note=lambda _: None
    )


def test_a_tool_episode_trains_exactly_the_sampled_tokens_and_the_stream_is_the_rendering():
    call = "Adding. " + format_tool_call("calculator", {"expression": "9 + 4"})
    first = _bytes_tokens(call) + [END]  # not the tokenizer's own encoding of the text
    second = TOKENIZER.encode("\\boxed{13}", add_special_tokens=False) + [END]
    sampler = ScriptedSampler([first, second])
    env = calculator_wordproblems(TASK)
    episode, usage, seen = _play(env, sampler)
    assert [turn.action_tokens.tolist() for turn in episode.turns] == [first, second]
    assert episode.reward == 1.0 and episode.turns[0].tool_calls == 1
    # Turn 2's prompt is turn 1's prompt + the sampled tokens as sampled + the tool response.
    assert sampler.prompts[1][: len(sampler.prompts[0]) + len(first)] == sampler.prompts[0] + first
    assert seen[1] == (
        "\n<|im_start|>user\n<tool_response>\n13\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The whole stream decodes to the template's rendering of the conversation.
    messages = [
        *env.initial_observation(),
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "13"},
    ]
    rendered = render(TOKENIZER, messages, env.tools) + "\\boxed{13}<|im_end|>"
    assert rendered.startswith("<|im_start|>system\n" + TOOL_SYSTEM_PROMPT + "\n\n# Tools\n")
    assert TOKENIZER.decode(episode.tokens.tolist(), skip_special_tokens=False) == rendered
    assert usage.completion_tokens == len(first) + len(second)


class EchoEnv:
    """Never done: answers every action with "again" (reward 0.25 a turn)."""

    def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    def step(self, action_text):
        return [{"role": "user", "content": "again"}], 0.25, False


def test_max_turns_bounds_an_episode_and_per_turn_rewards_add_up():
    episode, _usage, _seen = _play(EchoEnv(), ScriptedSampler([[300, END]] * 9))
    assert episode.num_turns == LIMITS.max_turns
    assert episode.reward == 0.25 * LIMITS.max_turns


def test_the_context_limit_ends_an_episode_and_caps_each_turn():
    prompt_len = len(TOKENIZER.encode(render(TOKENIZER, EchoEnv().initial_observation())))
    limits = EpisodeLimits(max_turns=9, max_tokens=6, max_len=prompt_len + 24, temperature=1.0)
    sampler = ScriptedSampler([[300] * 6] * 9, stop="length")
    episode, _usage, _seen = _play(EchoEnv(), sampler, limits)
    assert episode.num_turns >= 2 and episode.turns[0].stop_reason == "length"
    assert episode.turns[-1].stop_reason == "context" and episode.is_truncated
    assert all(len(prompt) < limits.max_len for prompt in sampler.prompts)
    assert episode.tokens.size <= limits.max_len


class ForgetfulTokenizer:
    """The tiny tokenizer with a template that re-renders earlier assistant turns shortened."""

    def __init__(self) -> None:
        self.inner = TOKENIZER

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, messages, **kwargs):
        shortened = [
            {**m, "content": m["content"][:3]} if m["role"] == "assistant" else m for m in messages
        ]
        return self.inner.apply_chat_template(shortened, **kwargs)


def test_a_template_that_re_renders_earlier_turns_differently_is_refused():
    with pytest.raises(TemplateError, match="grows by extension"):
        _play(
            EchoEnv(),
            ScriptedSampler([[300, 301, 302, 303, 304, END]] * 3),
            tokenizer=ForgetfulTokenizer(),
        )


def test_an_env_that_raises_or_breaks_the_protocol_is_an_env_error():
    class Raises(EchoEnv):
        def step(self, action_text):
            raise KeyError("boom")

    class BadReward(EchoEnv):
        def step(self, action_text):
            return StepResult((), float("nan"), True)

    with pytest.raises(EnvError, match="env.step raised KeyError"):
        _play(Raises(), ScriptedSampler([[300, END]]))
    with pytest.raises(EnvError, match="finite"):
        _play(BadReward(), ScriptedSampler([[300, END]]))


ENV_FILE = '''
class TwoTurns:
    """Turn 1 is answered with a question; turn 2 ends with reward = its length's parity."""

    def __init__(self, task):
        self.task = task

    def initial_observation(self):
        return list(self.task.messages)

    def step(self, action_text):
        if not getattr(self, "asked", False):
            self.asked = True
            return [{"role": "user", "content": "Are you sure? Answer again."}], 0.0, False
        return [], float(len(action_text) % 2), True


def make(task):
    return TwoTurns(task)
'''


def test_an_env_run_trains_multi_turn_episodes_on_exactly_the_sampled_tokens(tmp_path: Path):
    (tmp_path / "two_turns.py").write_text(ENV_FILE)
    config = tiny_config(
        tmp_path, "env", env=f"{tmp_path / 'two_turns.py'}:make", eval_every=2, eval_limit=4
    )
    rows = read_metrics(quiet_train(config).run_dir)
    trained = [row for row in rows if row.get("datums", 0) > 0]
    assert trained and all(row["env/turns"] == 2.0 for row in trained)
    # The trainer's log-probs of the trained tokens, in their multi-turn context, equal the
    # sampler's: the datums hold the tokens the policy sampled, where it sampled them.
    assert all(row["mismatch/max_abs_log_ratio"] < 1e-4 for row in trained)
    assert "test/reward" in rows[0] and "test/turns" in rows[0]
    again = read_metrics(quiet_train(tiny_config(tmp_path, "env2", **_env_of(config))).run_dir)
    assert_same_rows(comparable(again), comparable(rows))


def _env_of(config) -> dict[str, Any]:
    return {"env": config.env, "eval_every": config.eval_every, "eval_limit": config.eval_limit}


def test_env_flags_are_checked_before_any_run(tmp_path: Path):
    with pytest.raises(ConfigError, match="--max-turns"):
        tiny_config(tmp_path, env="grpo.envs:calculator_wordproblems", max_turns=0)
    config = tiny_config(tmp_path, "missing", env="grpo.envs:no_such_env")
    with pytest.raises(ConfigError, match="has no 'no_such_env'"):
        quiet_train(config)
    assert not (tmp_path / "missing" / "metrics.jsonl").exists()


def test_reference_logprobs_are_read_at_the_sampled_positions_of_episodes_and_completions():
    from types import SimpleNamespace

    from grpo.core.episodes import Episode, EpisodeGroup, Turn
    from grpo.core.records import Completion, ScoredGroup
    from grpo.training.rollouts.step import reference_logprobs

    class Reference:
        def compute_logprobs(self, prompt):
            future: Future = Future()
            future.set_result([None, *(-float(token) for token in prompt.to_ints()[1:])])
            return future

    turns = [
        Turn(observation_tokens=[1, 2], action_tokens=[3, 4], action_logprobs=[-1, -1]),
        Turn(observation_tokens=[5], action_tokens=[6], action_logprobs=[-1]),
    ]
    group = EpisodeGroup(episodes=[Episode(turns=turns)], advantages=[1.0])
    completion = Completion(tokens=[8, 9], logprobs=[-1, -1], text="", stop_reason="stop")
    completions = ScoredGroup(
        prompt_tokens=[1, 2, 3], completions=[completion], rewards=[0.0], advantages=[0.0]
    )
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        run = SimpleNamespace(
            ref_sampler=Reference(), pool=pool, config=SimpleNamespace(max_retries=0), note=print
        )
        values, usage = reference_logprobs(run, [group, completions])
    assert values.tolist() == [-3.0, -4.0, -6.0, -8.0, -9.0]
    assert usage.prompt_tokens == 6 + 5


def _episode(reward: float, tokens: int = 2) -> Any:
    from grpo.core.episodes import Episode, Turn

    turn = Turn(
        observation_tokens=[1],
        action_tokens=[7] * tokens,
        action_logprobs=[-1.0] * tokens,
        reward=reward,
    )
    return Episode(turns=[turn])


def test_played_groups_count_unequal_returns_and_extend_round_by_round():
    from grpo.core.usage import TokenUsage
    from grpo.training.rollouts.grading import PlayedGroups
    from grpo.training.rollouts.problems import Problem

    def played(returns_P: list[list[float]], tokens: int) -> PlayedGroups:
        return PlayedGroups(
            problems_P=tuple(Problem("q", "g", (1,), index=i) for i in range(len(returns_P))),
            episodes_P=tuple(tuple(_episode(r, tokens) for r in g) for g in returns_P),
            seen_P=tuple(tuple(("o",) for _ in g) for g in returns_P),
            usage=TokenUsage(completion_tokens=tokens),
        )

    first = played([[1.0, 1.0], [0.0, 0.5], [0.25, 0.25]], tokens=2)
    assert first.num_nondegenerate() == 1 and first.rounds == 1 and first.extra_tokens == 0
    both = first.extended(played([[0.0, 1.0], [2.0, 2.0]], tokens=3))
    assert both.num_nondegenerate() == 2 and both.rounds == 2
    assert both.extra_tokens == 2 * 2 * 3  # the action tokens of the extra round only
    assert len(both.problems_P) == len(both.episodes_P) == len(both.seen_P) == 5
    assert both.usage.completion_tokens == 2 + 3


PARITY_ENV = """
import re


class Parity:
    \"\"\"One turn; rows of even index return 0 (a degenerate group), odd ones the parity of
    the action's last digit.\"\"\"

    def __init__(self, task):
        self.task = task

    def initial_observation(self):
        return list(self.task.messages)

    def step(self, action_text):
        digits = re.findall("[0-9]", action_text)
        if KIND == "constant" or self.task.index % 2 == 0 or not digits:
            return [], 0.0, True
        return [], float(int(digits[-1]) % 2), True


KIND = "parity"


def make(task):
    return Parity(task)


def constant(task):
    global KIND
    KIND = "constant"
    return Parity(task)
"""


def _dynamic_env(tmp_path: Path, name: str, factory: str = "make", **overrides: Any):
    path = tmp_path / "parity_env.py"
    path.write_text(PARITY_ENV)
    values = dict(
        env=f"{path}:{factory}",
        steps=3,
        batch_size=3,
        dynamic_sampling=True,
        max_sampling_rounds=3,
        log_rollouts=100,
    )
    return tiny_config(tmp_path, name, **{**values, **overrides})


def test_dynamic_sampling_on_episodes_drops_equal_return_groups_and_samples_more(tmp_path: Path):
    import numpy as np

    from grpo.tasks.data import load_run_problems
    from grpo.training.run.run_files import read_rollouts
    from grpo.training.run.seeds import extra_batch, pick_batch
    from tests.test_tasks import _check_dynamic_invariants

    config = _dynamic_env(tmp_path, "parity")
    result = quiet_train(config)
    rows = read_metrics(result.run_dir)
    _check_dynamic_invariants(rows, batch_size=3, group_size=4, max_rounds=3)
    assert any(row["sampling/rounds"] > 1 for row in rows), "no extra round: test setup"
    nondegenerate = [round(row["num_groups"] * (1 - row["frac_degenerate"])) for row in rows]
    assert any(  # a step that sampled more unequal groups than train: only the first B do
        found > row["sampling/groups"] for found, row in zip(nondegenerate, rows, strict=True)
    ), "no over-full step: test setup"
    groups_by_step: dict[int, list[dict[str, Any]]] = {}
    for record in read_rollouts(result.run_dir):
        groups_by_step.setdefault(record["step"], []).append(record)
    num_train = len(load_run_problems(config, "train"))
    for row, (step, groups) in zip(rows, sorted(groups_by_step.items()), strict=True):
        assert len(groups) == row["num_groups"]
        for group in groups:  # degenerate exactly when every episode's return is equal
            returns = [episode["reward"] for episode in group["completions"]]
            assert group["degenerate"] == (len(set(returns)) == 1)
            assert group["degenerate"] or group["row"] % 2 == 1
        expected = list(pick_batch(num_train, 3, step - 1, config.seed))  # round 0, then
        for round_ in range(1, int(row["sampling/rounds"])):  # each round's new tasks
            expected += list(extra_batch(num_train, 3, step - 1, round_, config.seed))
        assert [group["row"] for group in groups] == [int(index) for index in expected]
        extra = sum(c["tokens"] for g in groups[3:] for c in g["completions"])
        assert row["sampling/extra_tokens"] == extra
        sampled = sum(c["tokens"] for g in groups for c in g["completions"])
        assert row["usage/completion_tokens"] == sampled  # every round's usage is counted
        assert np.isclose(row["frac_degenerate"], np.mean([g["degenerate"] for g in groups]))
    again = read_metrics(quiet_train(_dynamic_env(tmp_path, "parity-again")).run_dir)
    assert_same_rows(comparable(again), comparable(rows))  # deterministic under the seed


def test_dynamic_sampling_on_episodes_stops_at_the_round_cap_when_no_group_can_train(
    tmp_path: Path,
):
    rows = read_metrics(
        quiet_train(_dynamic_env(tmp_path, "constant", "constant", steps=1)).run_dir
    )
    assert rows[0]["sampling/rounds"] == 3 and rows[0]["sampling/groups"] == 0
    assert rows[0]["num_groups"] == 9 and rows[0]["frac_degenerate"] == 1.0
    assert rows[0]["datums"] == 0 and "loss" not in rows[0]


@pytest.mark.parametrize("max_off_policy", [1, 2])
def test_off_policy_episodes_are_sampled_ahead_and_never_more_than_k_stale(
    tmp_path: Path, max_off_policy: int
):
    (tmp_path / "two_turns.py").write_text(ENV_FILE)
    config = tiny_config(
        tmp_path,
        f"k{max_off_policy}",
        env=f"{tmp_path / 'two_turns.py'}:make",
        steps=5,
        max_steps_off_policy=max_off_policy,
    )
    rows = read_metrics(quiet_train(config).run_dir)
    staleness = [row["off_policy_steps"] for row in rows]
    trained = [row["datums"] > 0 for row in rows]
    # Step j's episodes were played when step max(0, j - k) began, so they are as many
    # optimizer steps old as steps in [max(0, j - k), j) trained.
    expected = [
        float(sum(trained[max(0, step - max_off_policy) : step])) for step in range(len(rows))
    ]
    assert staleness == expected, (trained, staleness)
    assert max(staleness) == max_off_policy, "the run never filled the pipeline: test setup"
    for row in rows:
        if row["datums"]:
            prefix = "mismatch" if row["off_policy_steps"] == 0 else "mismatch_and_staleness"
            assert f"{prefix}/kl_k3" in row, row
    assert all(row["env/turns"] == 2.0 for row in rows)


def test_dynamic_sampling_on_episodes_with_the_off_policy_pipeline(tmp_path: Path):
    from tests.test_tasks import _check_dynamic_invariants

    config = _dynamic_env(tmp_path, "k1", max_steps_off_policy=1, max_sampling_rounds=4)
    rows = read_metrics(quiet_train(config).run_dir)
    _check_dynamic_invariants(rows, batch_size=3, group_size=4, max_rounds=4)
    assert all(row["off_policy_steps"] <= 1 for row in rows)
    assert any(row["off_policy_steps"] == 1 for row in rows), "the pipeline never filled: setup"


def test_dry_run_of_an_env_run_bounds_sampled_tokens_by_turns_times_tokens(tmp_path: Path):
    import json

    from grpo.backends.local import LocalServiceClient
    from grpo.training.recipes.grpo.plan import plan_usage, preflight
    from grpo.training.recipes.grpo.run import dry_run

    (tmp_path / "echo.py").write_text(ECHO_ENV)
    env = f"{tmp_path / 'echo.py'}:make"
    flags = dict(env=env, max_turns=3, eval_every=2, eval_limit=3, steps=2)
    config = tiny_config(tmp_path, "plan", **flags)
    lines = dry_run(config)
    assert not (tmp_path / "plan").exists(), "a dry run wrote into its run dir"
    per_step = 2 * 4 * 3 * 24  # batch x group episodes, each --max-turns x --max-tokens
    (line,) = [line for line in lines if "episodes (--env)" in line]
    assert "--max-turns 3 x --max-tokens 24 = 72 sampled tokens each" in line
    assert f"<= {per_step:,} sampled tokens a step (an upper bound" in line
    assert any(
        "prompt tokens (sampler)" in line and "not planned under --env" in line for line in lines
    )
    planned = plan_usage(preflight(config, lambda: LocalServiceClient(root=tmp_path / "unused")))
    evals = 2 * 3 * 3 * 24  # before step 1 and after step 2: 3 test episodes each
    assert planned.completion_tokens == 2 * per_step + evals
    # Echo never ends an episode, so every one plays --max-turns turns: within the bound.
    run_dir = quiet_train(tiny_config(tmp_path, "run", **flags)).run_dir
    assert all(row["env/turns"] == 3.0 for row in read_metrics(run_dir) if "env/turns" in row)
    sampled = json.loads((run_dir / "summary.json").read_text())["usage"]["completion_tokens"]
    assert 0 < sampled <= planned.completion_tokens
    rounds = dry_run(tiny_config(tmp_path, "ds", **flags, dynamic_sampling=True))
    assert any(f"<= {3 * per_step:,} sampled tokens a step" in line for line in rounds)


ECHO_ENV = """
class Echo:
    def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    def step(self, action_text):
        return [{"role": "user", "content": "again"}], float(len(action_text) % 2), False


def make(task):
    return Echo()
"""


@pytest.mark.parametrize("max_off_policy", [0, 1])
def test_dynamic_sampling_on_episodes_resumes_exactly(tmp_path: Path, max_off_policy: int):
    import json

    from grpo.training.recipes.grpo.run import RunStopped
    from grpo.training.run.run_files import read_rollouts
    from tests.training.test_loop import _StopAfterOptimSteps

    # With K > 0 the episodes played ahead of the checkpoint are saved with it and reused.
    flags = dict(steps=4, max_steps_off_policy=max_off_policy)
    whole = quiet_train(_dynamic_env(tmp_path, "whole", **flags)).run_dir
    assert any(row["sampling/rounds"] > 1 for row in read_metrics(whole)), "test setup"
    config = _dynamic_env(tmp_path, "stopped", **flags)
    service = _StopAfterOptimSteps(
        embedded_service(tmp_path / "stopped" / "backend", seed=config.seed), n=2
    )
    with pytest.raises(RunStopped):
        quiet_train(config, service_client=service)
    checkpoint = json.loads((tmp_path / "stopped" / "checkpoint.json").read_text())["step"]
    assert 1 <= checkpoint < 4
    resumed = quiet_train(config, resume=True).run_dir
    assert_same_rows(comparable(read_metrics(resumed)), comparable(read_metrics(whole)))
    assert_same_rollouts(read_rollouts(resumed), read_rollouts(whole))
    if max_off_policy:
        assert max(row["off_policy_steps"] for row in read_metrics(whole)) > 0, "test setup"
