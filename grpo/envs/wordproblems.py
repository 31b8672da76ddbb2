"""The built-in tool task: word problems the model may solve with calculator calls.

An episode opens with a system message (the answer's format, then the run's system prompt)
and the run's prompt for the problem, and offers the calculator as a tool (`tools`: the chat
template lists its signature in the system turn, as Qwen3's does). Each action that contains
``<tool_call>`` blocks is answered with one ``tool`` message per call (reward 0, not done);
the first action without a call is the final answer, scored 1.0 when its last ``\\boxed{}``
matches the gold answer (the default reward, `grpo.core.rewards.grade`), and ends the
episode. Use it with the built-in word problems:

    grpo train --env grpo.envs:calculator_wordproblems --dataset wordproblems
"""

from __future__ import annotations

from grpo.core.rewards import grade
from grpo.envs.base import StepResult, Task
from grpo.envs.tools import CALCULATOR, ToolRegistry, format_tool_call

__all__ = ["TOOL_SYSTEM_PROMPT", "CalculatorEnv", "calculator_wordproblems", "tool_solution"]

TOOL_SYSTEM_PROMPT = "Use the calculator for the arithmetic. Put the final answer in \\boxed{}."
"""The episode's system message (the tools block follows it in the rendered system turn)."""
TOOLS = ToolRegistry.of(CALCULATOR)


class CalculatorEnv:
    """One episode of a word problem with the calculator tool (see the module docstring)."""

    def __init__(self, task: Task, registry: ToolRegistry = TOOLS) -> None:
        self.task, self.registry = task, registry
        self.tools = registry.signatures()  # offered through the chat template's `tools`

    def initial_observation(self) -> list[dict[str, str]]:
        """The system message (and the run's --system-prompt after it), then the prompt."""
        messages = [dict(message) for message in self.task.messages] or [
            {"role": "user", "content": self.task.question}
        ]
        system = [m["content"] for m in messages if m["role"] == "system"]
        rest = [m for m in messages if m["role"] != "system"]
        return [{"role": "system", "content": "\n".join([TOOL_SYSTEM_PROMPT, *system])}, *rest]

    def step(self, action_text: str) -> StepResult:
        """Tool calls are answered (reward 0); an action without one is graded and ends it."""
        observation, calls, errors = self.registry.respond(action_text)
        if calls:
            return StepResult(observation, 0.0, False, tool_calls=calls, tool_errors=errors)
        return StepResult((), grade(action_text, self.task.gold), True)


def calculator_wordproblems(task: Task) -> CalculatorEnv:
    """`--env grpo.envs:calculator_wordproblems`: a `CalculatorEnv` for the task."""
    return CalculatorEnv(task)


def tool_solution(answer: str) -> tuple[str, str]:
    """(the calculator call, the final answer) that solve a built-in problem's answer.

    A built-in answer is equation lines, then ``#### N`` (``grpo/tasks/data.py``); the call
    computes the whole chain at once (``9 + 4 = 13``, ``13 - 6 = 7`` -> ``9 + 4 - 6``), and the
    final answer boxes N. The tool warm start (``scripts/make_tiny_model.py --tools``) trains
    on these two turns.
    """
    *lines, gold_line = answer.split("\n")
    if not lines or not gold_line.startswith("#### ") or any("=" not in line for line in lines):
        raise ValueError(f"answer {answer!r} is not a built-in answer (equation lines, '#### N')")
    first, *rest = (line.split("=")[0].strip() for line in lines)
    expression = " ".join([first, *(step.split(" ", 1)[1] for step in rest)])
    gold = gold_line[len("#### ") :]
    return format_tool_call("calculator", {"expression": expression}), f"\\boxed{{{gold}}}"
