"""Code answers: the completion's last fenced Python block, run against the row's tests.

- `last_python_block`: the body of the last ```` ```python ```` (or ```` ```py ````, or bare
  ```` ``` ````) fenced block of a completion; None when it has none.
- `row_tests`: a row's `tests` column: Python text of assert statements, or a list of them
  (a JSON-encoded list in a CSV cell is decoded).
- `pass_fraction`: the fraction of the tests' assert statements that pass when the block
  runs in the sandbox of `grpo/sandbox.py` (0.0 without a block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from grpo.sandbox import SandboxLimits, run_tests

__all__ = ["last_python_block", "pass_fraction", "row_tests"]

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def last_python_block(text: str) -> str | None:
    """The body of the completion's last fenced Python (or unlabelled) block, else None."""
    blocks = _FENCED.findall(text)
    return blocks[-1] if blocks else None


def row_tests(row: Mapping[str, Any]) -> str | list[str]:
    """The row's `tests`: assert text or a list of it; ValueError naming the fix when absent."""
    if "tests" not in row:
        raise ValueError(
            f"the row has no `tests` column (columns: {sorted(row)}); code rewards need one "
            "holding Python assert statements or a list of them"
        )
    tests = row["tests"]
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass
    if isinstance(tests, str) or (
        isinstance(tests, list) and tests and all(isinstance(test, str) for test in tests)
    ):
        return tests
    raise ValueError(f"the row's `tests` is {tests!r}; expected assert text or a list of it")


def pass_fraction(
    completion: str, row: Mapping[str, Any], limits: SandboxLimits = SandboxLimits()
) -> float:
    """passed asserts / all asserts of the row's tests run on the last Python block (0 if none)."""
    tests = row_tests(row)
    solution = last_python_block(completion)
    if solution is None:
        return 0.0
    result = run_tests(solution, tests, limits)
    return result.passed / result.total
