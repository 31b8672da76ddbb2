"""Which steps of a run evaluate and which save a checkpoint: the one schedule.

The step loop follows it and the plan (`grpo.training.recipes.grpo.plan`, `grpo train
--dry-run`) counts it. A step is named by ``done``, the number of steps finished (1 after
the first step), the number its row is logged under.
"""

from __future__ import annotations

from grpo.training.settings.config import TrainConfig


def evaluates_at_start(config: TrainConfig, start_step: int) -> bool:
    """A baseline evaluation (row 0) before the first step of a run started from scratch."""
    return bool(config.eval_every) and start_step == 0


def evaluates_after(config: TrainConfig, done: int, steps: int) -> bool:
    """An evaluation after step ``done``: every --eval-every steps, and after the last one."""
    return bool(config.eval_every) and (done % config.eval_every == 0 or done == steps)


def saves_after(config: TrainConfig, done: int, steps: int) -> bool:
    """A periodic checkpoint after step ``done``: every --save-every steps before the last.

    The last step is always saved, as ``final``, once the loop ends.
    """
    return bool(config.save_every) and done % config.save_every == 0 and done < steps
