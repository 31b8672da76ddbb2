"""Run a script unchanged with `datasets.load_dataset("openai/gsm8k", ...)` answered offline.

The built-in `wordproblems` split (GSM8K's `question`/`answer` columns, `#### N` answers)
stands in for GSM8K; any other dataset loads as usual. Usage:

    python examples/with_builtin_data.py SCRIPT.py [SCRIPT ARGS...]
"""

import runpy
import sys

import datasets

from grpo.tasks.data import load_problems

_load_dataset = datasets.load_dataset


def load_dataset(path: str, *args: object, split: str | None = None, **kwargs: object) -> object:
    """GSM8K from the built-in word problems; everything else from `datasets` itself."""
    if path == "openai/gsm8k":
        return load_problems("wordproblems", split or "train")
    return _load_dataset(path, *args, split=split, **kwargs)


if __name__ == "__main__":
    datasets.load_dataset = load_dataset
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
