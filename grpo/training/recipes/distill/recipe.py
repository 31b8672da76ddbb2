"""On-policy distillation as a scorer on the GRPO step's rollouts (`grpo distill`).

docs/FORMULAS.md, "On-policy distillation". The student samples as the GRPO recipe does,
on completions or on an environment's episodes; then, in the step's own story:

- 2b. ``submit_scoring``: the teacher's log-probs q of every sampled token, requested while
  the step grades (`grpo.training.recipes.distill.teacher.TeacherScoring`: a completion after the
  teacher's prompt, an episode's whole stream read at its sampled tokens, so observations
  and tool outputs are never scored or trained).
- 6b. ``teacher_logprobs``: q placed on the packed batch's sampled positions.
- 7b. ``distill_now``: the batch's advantages A_t of `grpo.core.distill.distill_advantages`
  and the ``distill/*`` metrics; under --mismatch-correction recompute they are computed
  inside the update, on the trainer's log-probs (the update's ``reshape`` hook).
- ``teacher_test_metrics``: the teacher's own test reward, once, in the baseline row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from grpo.core.records import TokenBatch
from grpo.core.usage import TokenUsage
from grpo.training.recipes.distill.teacher import Teacher, TeacherScoring, distill_batch, in_update
from grpo.training.rollouts import step as rollouts
from grpo.training.rollouts.grading import PlayedGroups
from grpo.training.run.state import Run, RunState
from grpo.training.settings.config import TrainConfig


def submit_scoring(run: Run, sampled: rollouts.Sampled) -> TeacherScoring | None:
    """Step 2b: the teacher's scoring of every sampled token, submitted (None: no teacher): a
    completion after the teacher's prompt, an episode's stream at its sampled tokens."""
    teacher, config = run.teacher, run.config
    if teacher is None:
        return None
    if isinstance(sampled, PlayedGroups):
        episodes = [episode for group in sampled.episodes_P for episode in group]
        return TeacherScoring.of_episodes(
            teacher, episodes, max_retries=config.max_retries, note=run.note
        )
    return TeacherScoring.of_completions(
        teacher,
        sampled.problems_P,
        sampled.completions_P,
        max_retries=config.max_retries,
        note=run.note,
    )


def teacher_logprobs(
    state: RunState, scoring: TeacherScoring, batch: TokenBatch
) -> tuple[np.ndarray, dict[str, float]]:
    """Step 6b: q on the batch's sampled positions, and the scoring's time and tokens for the
    step's row (its usage counted into the row's)."""
    teacher_N = scoring.result_N(batch)
    state.usage += scoring.usage()
    return teacher_N, {
        "time/teacher": scoring.seconds(),
        "usage/teacher_prompt_tokens": float(scoring.num_tokens()),
    }


Reshape = Callable[[TokenBatch], tuple[TokenBatch, dict[str, float]]]
"""The update's hook: the corrected batch distilled, and its ``distill/*`` metrics."""


def distill_now(
    batch: TokenBatch, teacher_N: np.ndarray, config: TrainConfig
) -> tuple[TokenBatch, Reshape | None, dict[str, float]]:
    """Step 7b: the distilled batch now (s = the sampler's) and its ``distill/*`` metrics, or
    the batch and a hook for the update (s = the trainer's, under --mismatch-correction
    recompute)."""
    if in_update(config):
        return batch, lambda corrected: distill_batch(corrected, teacher_N, config), {}
    batch, found = distill_batch(batch, teacher_N, config)
    return batch, None, found


def teacher_test_metrics(run: Run, teacher: Teacher) -> tuple[dict[str, float], TokenUsage]:
    """The teacher's own test reward, evaluated as the student's (``distill/teacher_test_*``)."""
    metrics, usage = rollouts.evaluate_test(run, teacher.sampler)
    return {
        f"distill/teacher_{key.replace('/', '_')}": value for key, value in metrics.items()
    }, usage
