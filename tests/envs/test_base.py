"""Tests for grpo.envs.base and the built-in calculator word-problem environment."""

from pathlib import Path

import pytest

from grpo.envs import calculator_wordproblems, load_env_factory, make_group
from grpo.envs.base import (
    EnvError,
    StepResult,
    Task,
    as_step_result,
    check_messages,
    env_tools,
)
from grpo.envs.tools import CALCULATOR, format_tool_call
from grpo.envs.wordproblems import TOOL_SYSTEM_PROMPT

TASK = Task(
    question="Ann has 9 apples and buys 4 more. How many now?",
    gold="13",
    messages=({"role": "user", "content": "Ann has 9 apples and buys 4 more. How many now?"},),
)


def test_calculator_env_answers_tool_calls_then_grades_the_final_answer():
    env = calculator_wordproblems(TASK)
    opening = env.initial_observation()
    assert opening[0] == {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    assert opening[1] == dict(TASK.messages[0])
    assert env.tools == [CALCULATOR.signature()]  # offered through the chat template
    assert env_tools(env) == [CALCULATOR.signature()]
    result = env.step("I add. " + format_tool_call("calculator", {"expression": "9 + 4"}))
    assert (result.reward, result.done, result.tool_calls, result.tool_errors) == (0, False, 1, 0)
    assert result.observation == ({"role": "tool", "content": "13"},)
    assert env.step("The answer is \\boxed{13}") == StepResult((), 1.0, True)
    assert env.step("The answer is \\boxed{12}").reward == 0.0


def test_calculator_env_answers_a_malformed_call_with_an_error_observation():
    result = calculator_wordproblems(TASK).step("<tool_call>{oops</tool_call>")
    assert (result.done, result.tool_calls, result.tool_errors) == (False, 1, 1)
    assert "error" in result.observation[0]["content"]


def test_the_run_system_prompt_follows_the_tool_instructions():
    task = Task("q", "1", messages=({"role": "system", "content": "Be brief."},))
    (system,) = calculator_wordproblems(task).initial_observation()[:1]
    assert system["content"] == TOOL_SYSTEM_PROMPT + "\nBe brief."


class _Offers:
    def __init__(self, tools):
        self.tools = tools


def test_env_tools_are_checked_function_signatures():
    assert env_tools(object()) is None and env_tools(_Offers(None)) is None
    assert env_tools(_Offers([])) is None
    for bad, message in [
        ("calculator", "not a list"),
        ([1], "non-dict"),
        ([{"f": object()}], "not JSON"),
        ([{"d": "x" * 30_000}], "at most 20000"),
    ]:
        with pytest.raises(EnvError, match=message):
            env_tools(_Offers(bad))


def test_step_answers_are_checked_and_tuples_accepted():
    result = as_step_result(([{"role": "user", "content": "higher"}], 0.5, False), "env.step")
    assert result == StepResult(({"role": "user", "content": "higher"},), 0.5, False)
    for value, message in [
        ("text", "return \\(messages, reward, done\\)"),
        (([], float("nan"), True), "finite"),
        (([], "1", True), "finite float"),
        (([], 1.0, "yes"), "True or False"),
        (([{"role": "robot", "content": "x"}], 1.0, True), "message 0"),
        (StepResult((), 0.0, False, tool_calls=1, tool_errors=2), "tool_errors"),
    ]:
        with pytest.raises(EnvError, match=message):
            as_step_result(value, "env.step")
    with pytest.raises(EnvError, match="not a list of messages"):
        check_messages("hello", "initial_observation()")


def test_make_group_builds_g_distinct_envs_and_refuses_a_shared_one():
    envs = make_group(calculator_wordproblems, TASK, 4)
    assert len({id(env) for env in envs}) == 4
    shared = calculator_wordproblems(TASK)
    with pytest.raises(EnvError, match="same object twice"):
        make_group(lambda task: shared, TASK, 2)
    with pytest.raises(EnvError, match="no initial_observation"):
        make_group(lambda task: object(), TASK, 2)


def test_load_env_factory_from_a_module_and_a_file(tmp_path):
    assert load_env_factory("grpo.envs:calculator_wordproblems") is calculator_wordproblems
    path = tmp_path / "my_env.py"
    path.write_text("def make(task):\n    return None\n")
    assert load_env_factory(f"{path}:make").__name__ == "make"
    for spec, message in [
        ("grpo.envs", "must look like MODULE:FACTORY"),
        ("grpo.envs:nope", "has no 'nope'; its callables: "),
        ("no_such_module_xyz:make", "no module 'no_such_module_xyz'"),
        (f"{tmp_path / 'missing.py'}:make", "not found"),
        ("grpo.envs:__all__", "must look like|is a list"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_env_factory(spec)


def test_the_documented_guess_the_number_environment_plays_by_the_protocol():
    example = Path(__file__).resolve().parents[2] / "examples" / "guess_number.py"
    guide = (example.parents[1] / "docs" / "environments.md").read_text(encoding="utf-8")
    assert example.read_text(encoding="utf-8") in guide  # the guide shows the file as is
    make = load_env_factory(f"{example}:make")
    env = make(Task("", "", index=2))  # secret 15
    assert env.initial_observation()[0]["role"] == "user"
    assert as_step_result(env.step("maybe 10"), "step").observation[0]["content"] == "No, higher."
    assert as_step_result(env.step("no idea"), "step").done is False
    assert as_step_result(env.step("19"), "step").observation[0]["content"] == "No, lower."
    assert as_step_result(env.step("15"), "step") == StepResult((), 0.25, True)
