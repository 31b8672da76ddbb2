"""Multi-turn environments and tools; the built-in env factories you name with ``--env``.

- ``grpo.envs:calculator_wordproblems``: word problems with a calculator tool
  (`grpo/envs/wordproblems.py`).

The API (`grpo/envs/base.py`): a factory ``factory(task: Task) -> Env``; an `Env` has
``initial_observation() -> messages`` and ``step(action_text) -> (messages, reward, done)``
(or a `StepResult`). Tools (`grpo/envs/tools.py`): Qwen-style ``<tool_call>`` parsing, a
`ToolRegistry`, the `CALCULATOR`.
"""

from grpo.envs.base import Env, EnvError, StepResult, Task, load_env_factory, make_group
from grpo.envs.tools import CALCULATOR, Tool, ToolCall, ToolRegistry, calculate, parse_tool_calls
from grpo.envs.wordproblems import CalculatorEnv, calculator_wordproblems

__all__ = [
    "CALCULATOR",
    "CalculatorEnv",
    "Env",
    "EnvError",
    "StepResult",
    "Task",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "calculate",
    "calculator_wordproblems",
    "load_env_factory",
    "make_group",
    "parse_tool_calls",
]
