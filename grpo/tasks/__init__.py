"""What a run trains on: datasets (built-in and user files) and chat prompts.

`CODE_TASKS`: the built-in function-writing tasks (`question`, `answer` holding a
reference solution in a fenced block, `tests`), a JSONL file for `--dataset`.
"""

from pathlib import Path

CODE_TASKS = Path(__file__).with_name("code_tasks.jsonl")
