"""The GRPO recipe, told in the ten steps of docs/DESIGN.md ("One training step").

``train_step`` is steps 1-9 on the one rollout path (`grpo.training.rollouts.step`:
completions, or an environment's episodes under --env) and, with a teacher, on-policy distillation
(`grpo.training.recipes.distill.recipe` scores the same rollouts); step 10 (evaluate when due,
log, checkpoint) is the lifecycle's (`grpo.training.run.lifecycle`), which ``GrpoRecipe``
plugs into. The maths lives in ``grpo.core``, the update in ``grpo.training.run.learner``.

With ``max_steps_off_policy = K > 0``, sampling for the next K steps is submitted before
this step trains (`grpo.training.rollouts.sampling`), and a rollout is never used more than
K updates stale; a checkpoint keeps those rollouts beside it (`grpo.training.run.ahead`).
"""

from __future__ import annotations

import contextlib
import threading

from grpo.core.alignment import mask_sequences
from grpo.core.episodes import pack_rollout_groups, truncated_rollouts
from grpo.core.metrics import batch_metrics
from grpo.envs.base import stop_env_calls_on
from grpo.rewards.calls import reward_session
from grpo.training.recipes.distill.recipe import (
    distill_now,
    submit_scoring,
    teacher_logprobs,
    teacher_test_metrics,
)
from grpo.training.rollouts import step as rollouts
from grpo.training.rollouts.records import step_records
from grpo.training.run.ahead import prune_ahead, save_ahead
from grpo.training.run.faults import fault_point
from grpo.training.run.learner import current_sampler, shape_with_kl, update
from grpo.training.run.recipe import Session
from grpo.training.run.run_files import JsonObject
from grpo.training.run.run_log import console_line
from grpo.training.run.schedule import evaluates_after, evaluates_at_start, saves_after
from grpo.training.run.state import Run, RunState
from grpo.training.run.timing import timed


def train_step(run: Run, state: RunState, step: int) -> dict[str, float]:
    """Steps 1-9 of one training step; returns its metrics, not yet logged."""
    config = run.config
    timings: dict[str, float] = {}
    with timed("time/sample", timings):
        rollouts.submit_ahead(run, state, step)  # 1. pick the problems; 2. sample (K steps ahead)
        sampled, staleness = rollouts.take(run, state, step)  # 2. ... G completions (episodes)
        fault_point("sampled")
    scoring = submit_scoring(run, sampled)  # 2b. distill: the teacher scores them
    # 3. grade (--reward, or env returns); 4. advantages; 5. rollout metrics, then drop the
    # degenerate groups (under distillation the teacher scores all)
    graded = rollouts.grade(run, state, step, sampled, keep_all=scoring is not None)
    trainable_P = graded.trainable_P
    metrics = {**graded.metrics, "off_policy_steps": float(staleness)}
    if config.dynamic_sampling:
        metrics.update(graded.sampling_metrics())
    state.rollout_log = step_records(graded, run.tokenizer, config.log_rollouts)
    with timed("time/train", timings):
        batch = pack_rollout_groups(trainable_P, drop_degenerate=False)  # 6. align + pack
        teacher_N = None
        if scoring is not None:
            teacher_N, found = teacher_logprobs(state, scoring, batch)
            metrics.update(found)
        if config.mask_truncated:  # DAPO: truncated completions train no tokens
            batch = mask_sequences(batch, truncated_rollouts(trainable_P))
        if batch.num_train_tokens:
            if run.ref_sampler is not None:  # 7. KL shaping against the base model
                ref_logprobs_N, ref_usage = rollouts.reference_logprobs(run, trainable_P)
                batch, metrics["kl"] = shape_with_kl(batch, ref_logprobs_N, config)
                state.usage += ref_usage
            reshape = None
            if teacher_N is not None:  # 7b. distill: the teacher's log-probs as the advantages
                batch, reshape, found = distill_now(batch, teacher_N, config)
                metrics.update(found)
            metrics.update(batch_metrics(batch))
            metrics.update(update(run, state, batch, staleness, reshape))  # 8.-9. update, metrics
            state.version += 1
        else:
            metrics.update(batch_metrics(batch))
    return {**metrics, **timings}


class GrpoRecipe:
    """GRPO (and on-policy distillation) as the lifecycle drives it."""

    command = "train"
    progress_label = "grpo"
    steps_word = "steps"

    def __init__(self, run: Run) -> None:
        self.run = run
        self.session = Session(
            run_dir=run.run_dir,
            run_name=str(run.config.run_name or run.run_dir.name),
            steps=run.steps,
            training_client=run.training_client,
            logger=run.logger,
            note=run.note,
            prices=run.prices,
            max_retries=run.config.max_retries,
        )

    def step(self, state: RunState, step: int) -> dict[str, float]:
        """Steps 1-9 (`train_step`), and the judge's tokens and counts (`judge/*`)."""
        metrics = train_step(self.run, state, step)
        if self.run.judge is not None:
            usage, counts = self.run.judge.take_metrics()
            state.usage += usage
            metrics.update(counts)
        return metrics

    def evaluates_after(self, done: int) -> bool:
        """Every --eval-every steps, after the last, and before the first of a fresh run."""
        if done == 0:
            return evaluates_at_start(self.run.config, 0)
        return evaluates_after(self.run.config, done, self.run.steps)

    def evaluate(self, state: RunState) -> dict[str, float]:
        """The test split graded as the run trains, on the current weights."""
        fault_point("eval")
        metrics, usage = rollouts.evaluate_test(self.run, current_sampler(self.run, state))
        state.usage += usage
        if self.run.judge is not None:  # the test completions' judge calls: test/judge_*
            usage, counts = self.run.judge.take_metrics("test/judge_")
            state.usage += usage
            metrics.update(counts)
        return metrics

    def baseline(self, state: RunState) -> dict[str, float]:
        """The evaluation before training and, distilling, the teacher's own (once)."""
        metrics = self.evaluate(state)
        if self.run.teacher is not None:
            found, usage = teacher_test_metrics(self.run, self.run.teacher)
            metrics.update(found)
            state.usage += usage
        return metrics

    def saves_after(self, done: int) -> bool:
        """Every --save-every steps before the last."""
        return saves_after(self.run.config, done, self.run.steps)

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """The article's one-line summary of a step."""
        return console_line(step, self.run.steps, metrics)

    def save_beside(self, state: RunState, state_path: str) -> None:
        """Under --max-steps-off-policy, the rollouts sampled ahead go with the weights."""
        if self.run.config.max_steps_off_policy:
            save_ahead(self.run.run_dir, state.completed, state_path, state.jobs, state.version)

    def saved(self, state: RunState) -> None:
        """The previous checkpoint's rollouts sampled ahead are not needed now."""
        if self.run.config.max_steps_off_policy:
            prune_ahead(self.run.run_dir, state.completed)

    def calls(self, stop: threading.Event) -> contextlib.AbstractContextManager[object]:
        """The reward workers (--reward-workers) for the whole run, and env calls that give
        up once the run is stopping (so a hung env cannot keep a stop from ending)."""
        config = self.run.config
        calls = contextlib.ExitStack()
        calls.enter_context(stop_env_calls_on(stop))
        calls.enter_context(
            reward_session(
                config.reward_fns,
                workers=config.reward_workers,
                timeout=config.reward_timeout,
                stop=stop,
                note=self.run.note,
                judge=self.run.judge,
            )
        )
        return calls

    def summary(self, state: RunState) -> JsonObject:
        """summary.json's final test reward."""
        return {"test/reward": state.last_metrics.get("test/reward")}

    def close(self, state: RunState) -> None:
        """Cancel the sampling in flight; release the pools."""
        for pending in state.jobs.values():
            pending.cancel()
        self.run.pool.shutdown(wait=False, cancel_futures=True)
        if self.run.teacher is not None:
            self.run.teacher.close()
        if self.run.judge is not None:
            self.run.judge.close()
