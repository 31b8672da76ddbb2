"""grpo: run and study GRPO on LLMs, on the PyTRIO service or an embedded local backend.

From Python (a notebook, a script):

    from grpo import TrainConfig, train, evaluate

    result = train(TrainConfig(steps=10, run_name="notebook"))  # the default job, 10 steps
    result.final_metrics["reward"]                               # the last step's metrics
    evaluate(result.run_dir, limit=100)                          # {"test/reward": ..., ...}

`TrainConfig` takes every `grpo train` flag as a field (same names, underscores for
dashes). `import grpo` loads no torch: each name is imported on first use. The layout of the
package is in `docs/DESIGN.md`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first access).
_PUBLIC = {
    "ConfigError": "grpo.training.settings.config",
    "RunResult": "grpo.training.recipes.grpo.run",
    "RunStopped": "grpo.training.recipes.grpo.run",
    "TrainConfig": "grpo.training.settings.config",
    "evaluate": "grpo.tools.evaluate",
    "train": "grpo.training.recipes.grpo.run",
}
__all__ = ["ConfigError", "RunResult", "RunStopped", "TrainConfig", "evaluate", "train"]

if TYPE_CHECKING:
    from grpo.tools.evaluate import evaluate
    from grpo.training.recipes.grpo.run import RunResult, RunStopped, train
    from grpo.training.settings.config import ConfigError, TrainConfig


def __getattr__(name: str) -> Any:
    """The public names of `__all__`, each imported from its module on first access."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
