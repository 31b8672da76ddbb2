"""Tools: Qwen-style tool calls, a registry that answers them, and the built-in calculator.

Qwen3's format: a call is ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``
in the policy's text, each answer a ``tool`` message, which Qwen3's chat template (and the
built-in one) renders as ``<tool_response>\\nTEXT\\n</tool_response>`` in one user turn; the
tools are offered as function signatures (`ToolRegistry.signatures`) that the template lists
in the system turn. Model text is untrusted: a call that is not valid JSON, names no known
tool, has bad arguments, or whose tool fails is answered with an error text (counted as a
tool error), never a crash.

- `parse_tool_calls`: the calls of one action, each a `ToolCall` or the reason it is malformed.
- `Tool`, `ToolRegistry`: named tools and `respond`, the observation answering one action.
- `calculate`, `CALCULATOR`: arithmetic on numbers with + - * / // % **, parentheses and
  unary minus, evaluated over the `ast` (never `eval`), with bounded size and exponent.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

__all__ = [
    "CALCULATOR",
    "MAX_CALLS",
    "MAX_EXPRESSION_CHARS",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "calculate",
    "format_tool_call",
    "parse_tool_calls",
    "tool_messages",
    "tool_response",
]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_CALLS = 32

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 256
MAX_INT_BITS = 1024
_RESPONSE_CHARS = 200


@attrs.frozen
class ToolCall:
    """One parsed call: the tool's name and its arguments, or ``error`` when it is malformed."""

    name: str = ""
    arguments: Mapping[str, Any] = attrs.field(factory=dict)
    error: str | None = None


def _parse_one(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # ValueError: also an integer over 4300 digits
        return ToolCall(error='the tool call is not JSON; write {"name": ..., "arguments": {...}}')
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(error='the tool call needs a "name" string and an "arguments" object')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(name=value["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=value["name"], arguments=arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order; an unclosed one is malformed.

    One left-to-right scan (linear in the text's length); past `MAX_CALLS` calls, one more
    malformed call stands for the rest.
    """
    calls: list[ToolCall] = []
    start = text.find(CALL_OPEN)
    while start != -1:
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end == -1:
            calls.append(ToolCall(error=f"the tool call is not closed with {CALL_CLOSE}"))
            break
        if len(calls) == MAX_CALLS:
            calls.append(ToolCall(error=f"more than {MAX_CALLS} tool calls in one turn"))
            break
        calls.append(_parse_one(text[start + len(CALL_OPEN) : end]))
        start = text.find(CALL_OPEN, end + len(CALL_CLOSE))
    return calls


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of one call, as a Qwen3 model writes it and the chat template renders an
    assistant's ``tool_calls``: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def tool_messages(texts: Iterable[str]) -> list[dict[str, str]]:
    """One ``tool`` message per answer: the chat template renders consecutive ones as one user
    turn of ``<tool_response>`` blocks, as Qwen3's does (the text of `tool_response`)."""
    return [{"role": "tool", "content": text} for text in texts]


def tool_response(texts: Iterable[str]) -> dict[str, str]:
    """One user message holding a ``<tool_response>`` block per answer (Qwen's rendering of
    the `tool_messages` of the same texts, for templates without a ``tool`` role)."""
    blocks = [f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}" for text in texts]
    return {"role": "user", "content": "\n".join(blocks)}


@attrs.frozen
class Tool:
    """A named tool: ``fn(arguments) -> text``; ValueError or TypeError means a bad call.
    ``parameters`` is the JSON schema of its arguments (what the chat template shows)."""

    name: str
    description: str
    fn: Callable[[Mapping[str, Any]], str] = attrs.field(eq=False)
    parameters: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "object"})

    def signature(self) -> dict[str, Any]:
        """The function signature a chat template's ``tools`` takes (OpenAI's and Qwen3's
        ``{"type": "function", "function": {name, description, parameters}}``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@attrs.frozen
class ToolRegistry:
    """Tools by name, and the answers to an action's calls."""

    tools: Mapping[str, Tool] = attrs.field(factory=dict)

    @classmethod
    def of(cls, *tools: Tool) -> ToolRegistry:
        """A registry of ``tools`` (names must be distinct)."""
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct, got {names}")
        return cls(tools={tool.name: tool for tool in tools})

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """(answer text, is_error) of one call; a malformed call or a failing tool is an error."""
        if call.error is not None:
            return f"error: {call.error}", True
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"error: unknown tool {call.name[:40]!r}; tools: {known}", True
        try:
            return str(tool.fn(call.arguments))[:_RESPONSE_CHARS], False
        except (ValueError, TypeError, ArithmeticError, KeyError) as error:
            return f"error: {str(error)[:_RESPONSE_CHARS]}", True

    def signatures(self) -> list[dict[str, Any]]:
        """Every tool's `Tool.signature`, in registration order (a chat template's ``tools``)."""
        return [tool.signature() for tool in self.tools.values()]

    def respond(self, action_text: str) -> tuple[list[dict[str, str]], int, int]:
        """The observation answering an action's calls: (one ``tool`` message per call, or [],
        the number of calls, the number answered with an error)."""
        calls = parse_tool_calls(action_text)
        if not calls:
            return [], 0, 0
        answers = [self.call(call) for call in calls]
        errors = sum(is_error for _text, is_error in answers)
        return tool_messages(text for text, _ in answers), len(calls), errors


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result is too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        if base not in (-1, 0, 1) and exponent * abs(base).bit_length() > MAX_INT_BITS + 64:
            raise ValueError(f"the result is too large (over {MAX_INT_BITS} bits)")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("0 cannot be raised to a negative power")
    result = base**exponent
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power is not a real number")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise ValueError(
        "only numbers, + - * / // % **, parentheses and unary minus are allowed, got "
        f"{type(node).__name__}"
    )


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text; ValueError (or ZeroDivisionError)
    for anything but numbers, + - * / // % **, parentheses and unary minus, or a huge result."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError('"expression" must be a non-empty string such as "3 * (4 + 5)"')
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"cannot parse {expression[:40]!r} as arithmetic") from None
    try:
        return _format_number(_evaluate(tree.body))
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    except OverflowError:
        raise ValueError("the result is too large") from None


def _calculator(arguments: Mapping[str, Any]) -> str:
    unknown = sorted(set(arguments) - {"expression"})
    if unknown:
        raise ValueError(f'unknown argument {unknown[0]!r}; the calculator takes "expression"')
    return calculate(arguments.get("expression", ""))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression.",
    fn=_calculator,
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
)
