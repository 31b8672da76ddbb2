"""Tests for grpo.envs.tools: the calculator (no eval, bounded) and Qwen-style tool calls."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.envs.tools import (
    CALCULATOR,
    MAX_EXPRESSION_CHARS,
    Tool,
    ToolCall,
    ToolRegistry,
    calculate,
    format_tool_call,
    parse_tool_calls,
    tool_response,
)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2", "3"),
        ("9 - 4 * 2", "1"),
        ("(9 - 4) * 2", "10"),
        ("-3 + 5", "2"),
        ("--3", "3"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("1.5 * 4", "6"),
        ("10 / 3", "3.33333333333"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("open('x')", "only numbers"),
        ("x + 1", "only numbers"),
        ("[1, 2]", "only numbers"),
        ("True + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1 if 1 else 2", "only numbers"),
        ("(lambda: 1)()", "only numbers"),
        ("2 ** 100000", "exponent"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 200 * 10 ** 200", "too large"),
        ("1e308 * 10", "not a finite"),
        ("1e999", "not a finite"),
        ("1.5 ** 5000", "exponent"),
        ("10.0 ** 256 * 10.0 ** 256", "not a finite"),
        ("(-8) ** 0.5", "not a real"),
        ("1 +", "cannot parse"),
        ("", "non-empty"),
        ("1" + "+1" * MAX_EXPRESSION_CHARS, "longer than"),
        ("(" * 90 + "1" + ")" * 80, "cannot parse"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


@pytest.mark.parametrize("expression", ["1 / 0", "1 // 0", "1 % 0", "0 ** -1", "1.0 / 0.0"])
def test_calculator_division_by_zero_is_an_error(expression):
    with pytest.raises(ZeroDivisionError):
        calculate(expression)


@given(a=st.integers(-(10**6), 10**6), b=st.integers(-(10**6), 10**6))
def test_calculator_agrees_with_python_on_integer_arithmetic(a, b):
    assert calculate(f"{a} + {b}") == str(a + b)
    assert calculate(f"{a} - ({b})") == str(a - b)
    assert calculate(f"{a} * {b}") == str(a * b)
    if b:
        assert calculate(f"{a} // {b}") == str(a // b)
        assert calculate(f"({a}) % ({b})") == str(a % b)


@given(text=st.text(max_size=60))
def test_calculator_on_any_text_answers_or_raises_a_clear_error(text):
    try:
        calculate(text)
    except (ValueError, ZeroDivisionError):
        pass


def test_parse_tool_calls_reads_qwen_style_calls_in_order():
    text = (
        "First <tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": "1+2"}})
        + '</tool_call> then <tool_call>{"name": "calculator", "arguments": '
        '"{\\"expression\\": \\"3*4\\"}"}</tool_call>'
    )
    first, second = parse_tool_calls(text)
    assert (first.name, dict(first.arguments), first.error) == (
        "calculator",
        {"expression": "1+2"},
        None,
    )
    assert dict(second.arguments) == {"expression": "3*4"}  # arguments sent as a JSON string
    assert parse_tool_calls("no calls here \\boxed{3}") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>not json</tool_call>", "not JSON"),
        ("<tool_call>[1, 2]</tool_call>", '"name" string'),
        ('<tool_call>{"name": 3}</tool_call>', '"name" string'),
        ('<tool_call>{"name": "calculator", "arguments": 5}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", "not JSON"),
    ],
)
def test_malformed_calls_are_parsed_as_errors_not_crashes(text, message):
    (call,) = parse_tool_calls(text)
    assert call.error is not None and message in call.error


def test_registry_answers_calls_with_tool_responses_and_counts_errors():
    registry = ToolRegistry.of(CALCULATOR)
    action = (
        format_tool_call("calculator", {"expression": "6 * 7"})
        + format_tool_call("calculator", {"expression": "1 / 0"})
        + format_tool_call("search", {"q": "x"})
        + format_tool_call("calculator", {"expr": "1"})
        + "<tool_call>oops</tool_call>"
    )
    messages, calls, errors = registry.respond(action)
    assert (calls, errors) == (5, 4)
    assert [message["role"] for message in messages] == ["tool"] * 5
    blocks = [message["content"] for message in messages]
    assert blocks[0] == "42"
    assert "division by zero" in blocks[1]
    assert "unknown tool 'search'; tools: calculator" in blocks[2]
    assert "unknown argument 'expr'" in blocks[3]
    assert "not JSON" in blocks[4]
    assert registry.respond("just an answer \\boxed{42}") == ([], 0, 0)
    # rendered, the tool messages are the user turn of <tool_response> blocks tool_response
    # writes (Qwen3's rendering of consecutive tool messages)
    from grpo.backends.local.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    question = {"role": "user", "content": "q"}

    def rendered(answer):
        return tokenizer.apply_chat_template([question, *answer], tokenize=False)

    assert rendered(messages) == rendered([tool_response(blocks)])


def test_format_tool_call_writes_qwen3s_call_and_parses_back():
    text = format_tool_call("calculator", {"expression": "9 + 4"})
    assert text == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "9 + 4"}}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "9 + 4"})]


def test_a_tool_that_raises_a_bad_call_error_is_answered_with_it():
    def broken(arguments):
        raise TypeError("wrong type")

    registry = ToolRegistry.of(Tool("broken", "raises", broken))
    (message,), calls, errors = registry.respond(format_tool_call("broken", {}))
    assert (calls, errors) == (1, 1)
    assert "error: wrong type" in message["content"]
    with pytest.raises(ValueError, match="distinct"):
        ToolRegistry.of(CALCULATOR, CALCULATOR)


def test_parsing_sixteen_thousand_unclosed_calls_is_linear() -> None:
    import time

    start = time.monotonic()
    calls = parse_tool_calls("<tool_call>" * 16000)
    assert time.monotonic() - start < 0.5  # the lazy regex took 13 s
    assert [call.error for call in calls] == ["the tool call is not closed with </tool_call>"]
    many = parse_tool_calls(format_tool_call("calculator", {"expression": "1"}) * 1000)
    assert len(many) == 33 and many[-1].error == "more than 32 tool calls in one turn"


def test_a_five_thousand_digit_integer_is_a_tool_error_not_a_crash() -> None:
    registry = ToolRegistry.of(CALCULATOR)
    huge = "9" * 5000
    for body in (
        f'{{"name": "calculator", "arguments": {{"expression": {huge}}}}}',
        f'{{"name": "calculator", "arguments": "{{\\"expression\\": {huge}}}"}}',
    ):
        messages, calls, errors = registry.respond(f"<tool_call>{body}</tool_call>")
        assert (calls, errors) == (1, 1)
        assert "error:" in messages[0]["content"]
