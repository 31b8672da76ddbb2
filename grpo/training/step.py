"""One GRPO training step, told in the ten steps of docs/DESIGN.md ("One training step").

``run_step`` is a whole step: ``train_step`` (steps 1-9: pick problems, sample, grade,
advantages, drop degenerate groups, pack, KL shaping, update, client-side metrics), then
step 10: evaluate when due, log the row, checkpoint when due. Sampling, grading and
evaluation live in ``grpo.training.rollouts``, the maths in ``grpo.core``, the schedule in
``grpo.training.schedule``; the run around the steps (resume, signals, summary) is
``grpo.training.run``.

With ``max_steps_off_policy = K > 0``, sampling for the next K steps is submitted before
this step trains, and a rollout is never used more than K updates stale.

Durability: a step's row reaches disk before any checkpoint that covers it, and a
checkpoint is only taken of weights whose step has been logged, so a checkpoint never
points past the last complete row and no row is logged twice (docs/RELIABILITY.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from pytrio.types import SamplingParams

from grpo.backends.datums import batch_to_datums, forward_only, output_logprobs
from grpo.backends.pytrio import call_with_retries
from grpo.core.advantages import kl_shaped_advantages
from grpo.core.alignment import mask_sequences, minibatches, pack_groups, truncated_sequences
from grpo.core.metrics import batch_metrics, mismatch_metrics, rollout_metrics, update_metrics
from grpo.core.mismatch import correct_batch
from grpo.core.records import TokenBatch
from grpo.core.usage import TokenUsage, reference_usage, training_usage, usage_metrics
from grpo.training import run_files
from grpo.training.ahead import prune_ahead, save_ahead
from grpo.training.config import TrainConfig
from grpo.training.custom_loss import as_custom_loss
from grpo.training.faults import fault_point
from grpo.training.logging import console_line, rollout_records
from grpo.training.plan import runs_extra_forward
from grpo.training.rollouts import (
    Problem,
    RolloutJob,
    Sampling,
    StepRollouts,
    evaluate,
    extra_batch,
    extra_sampling_seed,
    grade_rollouts,
    reference_logprobs,
    refill,
    sampling_seed,
    score_groups,
    step_problems,
    trainable_groups,
)
from grpo.training.schedule import checkpoint_follows, evaluates_after, saves_after
from grpo.training.state import Run, RunState
from grpo.training.timing import timed


class NonFiniteUpdate(RuntimeError):
    """An update whose loss or log-probs are not finite; raised before its optimizer step."""


def run_step(run: Run, state: RunState, step: int, write: Callable[[str], None]) -> None:
    """Step ``step`` whole: steps 1-9 (``train_step``), then step 10 (evaluate, log, save)."""
    config, done = run.config, step + 1
    metrics: dict[str, float] = {}
    with timed("time/step", metrics):
        metrics.update(train_step(run, state, step))
        if evaluates_after(config, done, run.steps):  # 10. evaluate when due,
            metrics.update(evaluate_now(run, state))
    if checkpoint_follows(config, done, run.steps):
        state.usage += checkpoint_check_usage(state)  # logged with this row
    log_step(run, state, done, metrics, write)  # log the step's row,
    if saves_after(config, done, run.steps):  # and save a resumable checkpoint when due
        save_checkpoint(run, state, f"step-{done:06d}")


def train_step(run: Run, state: RunState, step: int) -> dict[str, float]:
    """Steps 1-9 of one training step; returns its metrics, not yet logged."""
    config = run.config
    if config.env is not None:  # --env: multi-turn episodes instead of single completions
        from grpo.training.episodes import train_episode_step

        return train_episode_step(run, state, step)
    timings: dict[str, float] = {}
    with timed("time/sample", timings):
        submit_rollouts(run, state, step)  # 1. pick the problems; 2. sample them (async)
        job, staleness = take_rollouts(run, state, step)
        completions_P = job.result()  # 2. ... a group of G completions per prompt
        state.usage += job.usage()
        fault_point("sampled")
    scoring = submit_teacher(run, job.problems, completions_P)  # 2b. distill: the teacher scores
    rollouts = grade_rollouts(job.problems, completions_P, config)  # 3. grade (--reward)
    if config.dynamic_sampling:  # DAPO: sample more prompts until batch_size groups can train
        rollouts = refill(
            rollouts,
            needed=config.batch_size,
            max_rounds=config.max_sampling_rounds,
            sample_round=lambda round_: sample_extra_round(run, state, step, round_),
        )
    groups_P = score_groups(  # 4. group advantages (a group of equal rewards is degenerate)
        rollouts.problems_P, rollouts.completions_P, rollouts.scores.totals_P, config.advantage
    )
    metrics = {  # 5. record the rollout metrics, then drop the degenerate groups
        **rollout_metrics(groups_P),
        **rollouts.scores.metrics(),
        "off_policy_steps": float(staleness),
    }
    limit = config.batch_size if config.dynamic_sampling else None
    trainable_P = trainable_groups(groups_P, limit) if scoring is None else list(groups_P)
    if config.dynamic_sampling:
        metrics.update(sampling_metrics(rollouts, trainable_P))
    state.rollout_log = rollout_records(rollouts, groups_P, run.tokenizer, config.log_rollouts)
    with timed("time/train", timings):
        batch = pack_groups(trainable_P, drop_degenerate=False)  # 6. align + pack a TokenBatch
        teacher_N = None if scoring is None else teacher_logprobs(state, scoring, batch, metrics)
        if config.mask_truncated:  # DAPO: truncated completions train no tokens
            batch = mask_sequences(batch, truncated_sequences(trainable_P))
        if batch.num_train_tokens:
            if run.ref_sampler is not None:  # 7. KL shaping against the base model
                ref_logprobs_N = reference_logprobs(
                    run.pool, run.ref_sampler, trainable_P, config.max_retries, run.note
                )
                batch, metrics["kl"] = shape_with_kl(batch, ref_logprobs_N, config)
                state.usage += reference_usage(trainable_P)
            reshape = None
            if teacher_N is not None:  # 7b. distill: the teacher's log-probs as the advantages
                batch, reshape = distill_now(batch, teacher_N, config, metrics)
            metrics.update(batch_metrics(batch))
            metrics.update(update(run, state, batch, staleness, reshape))  # 8.-9. update, metrics
            state.version += 1
        else:
            metrics.update(batch_metrics(batch))
    return {**metrics, **timings}


def submit_rollouts(
    run: Run,
    state: RunState,
    step: int,
    submit: Callable[[list[Problem], int], Any] | None = None,
) -> None:
    """Submit the sampling of steps ``step`` .. ``step + K`` not yet in flight (K = off-policy).

    ``submit(problems, ahead)`` starts step ``ahead``'s job on the current weights (default:
    G completions per problem; --env passes its episodes' submitter).
    """
    config = run.config
    if submit is None:

        def submit(problems: list[Problem], ahead: int) -> Any:
            return _sample(run, state, problems, _sampling_params(config, ahead))

    last = min(step + config.max_steps_off_policy, run.steps - 1)
    for ahead in range(step, last + 1):
        if ahead in state.jobs:
            continue
        problems = step_problems(run.train_problems, config.batch_size, ahead, config.seed)
        state.jobs[ahead] = submit(problems, ahead)


def take_rollouts(run: Run, state: RunState, step: int) -> tuple[Any, int]:
    """Step ``step``'s job out of the in-flight ones, and its staleness (<= K, or an error)."""
    config = run.config
    job = state.jobs.pop(step)
    staleness = state.version - job.sampler_version
    if staleness > config.max_steps_off_policy:
        raise AssertionError(
            f"rollouts {staleness} steps stale > --max-steps-off-policy "
            f"{config.max_steps_off_policy}"
        )
    return job, staleness


def _sample(
    run: Run, state: RunState, problems: list[Problem], params_for: Callable[[int], SamplingParams]
) -> RolloutJob:
    """A group of --group-size completions per problem, from the sampler of the current weights."""
    sampling = Sampling(run.pool, run.tokenizer, run.config.max_retries, run.note)
    return sampling.submit(
        current_sampler(run, state),
        problems,
        params_for,
        num_samples=run.config.group_size,
        sampler_version=state.version,
    )


def _sampling_params(
    config: TrainConfig, step: int, round_: int = 0
) -> Callable[[int], SamplingParams]:
    def params(index: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=(
                sampling_seed(config.seed, step, index)
                if round_ == 0
                else extra_sampling_seed(config.seed, step, round_, index)
            ),
        )

    return params


def sample_extra_round(run: Run, state: RunState, step: int, round_: int) -> StepRollouts:
    """Dynamic sampling's round ``round_`` of ``step``: new problems and seeds, current weights."""
    config = run.config
    indices = extra_batch(len(run.train_problems), config.batch_size, step, round_, config.seed)
    problems = [run.train_problems[index] for index in indices]
    job = _sample(run, state, problems, _sampling_params(config, step, round_))
    completions_P = job.result()
    state.usage += job.usage()  # the step's row counts every round's tokens
    return grade_rollouts(problems, completions_P, config)


def sampling_metrics(rollouts: Any, trainable_P: list[Any]) -> dict[str, float]:
    """Dynamic sampling's cost and result: rounds, extra completion tokens, groups that train.

    ``rollouts`` is a `StepRollouts` or, under --env, a `grpo.training.episodes.PlayedGroups`.
    """
    return {
        "sampling/rounds": float(rollouts.rounds),
        "sampling/extra_tokens": float(rollouts.extra_tokens),
        "sampling/groups": float(len(trainable_P)),
    }


def current_sampler(run: Run, state: RunState) -> Any:
    """A sampling client on the current weights, refreshed once per update."""
    if state.sampler_version != state.version:
        state.sampler = retry(
            run,
            run.training_client.save_weights_and_get_sampling_client,
            "save_weights_and_get_sampling_client",
        )
        state.sampler_version = state.version
    return state.sampler


def shape_with_kl(
    batch: TokenBatch, ref_logprobs_N: np.ndarray, config: TrainConfig
) -> tuple[TokenBatch, float]:
    """The batch with KL-to-base shaping folded into its advantages, and the mean KL estimate."""
    mask = np.asarray(batch.mask, dtype=bool)
    ref_flat = np.zeros(mask.size, dtype=np.float64)
    ref_flat[mask] = ref_logprobs_N
    shaped, kl_mean = kl_shaped_advantages(
        batch.advantages,
        batch.sampling_logprobs,
        ref_flat,
        mask,
        kl_coef=config.kl_coef,
        estimator=config.kl_estimator,
    )
    return attrs.evolve(batch, advantages=shaped), kl_mean


def update(
    run: Run,
    state: RunState,
    batch: TokenBatch,
    staleness: int = 0,
    reshape: Callable[[TokenBatch], tuple[TokenBatch, dict[str, float]]] | None = None,
) -> dict[str, float]:
    """Epochs x minibatches of forward_backward + optim_step; metrics averaged over them.

    ``ratio/max_abs_log`` is the maximum over the updates. Each update's loss is checked
    finite before its optimizer step, so non-finite numbers never reach the weights. The
    mismatch metrics come from the trainer's log-probs before the step's first update (the
    first minibatch's, or the proximal forward's when a correction is on). ``reshape``
    rewrites the corrected batch before the first update (distillation under recompute).
    """
    config, client, spec = run.config, run.training_client, run.config.loss_spec
    loss_fn_config = spec.to_loss_fn_config()
    collected: list[dict[str, float]] = []
    batch, measured = correct_for_mismatch(run, batch, staleness)
    reshaped: dict[str, float] = {}
    if reshape is not None:
        batch, reshaped = reshape(batch)
    if config.mismatch.enabled:  # the proximal forward: once a step, every position
        state.usage += TokenUsage(forward_tokens=batch.num_tokens)
    with_mask = config.mismatch.enabled and spec.reduction != "sum"
    parts = minibatches(batch, config.num_substeps)  # 8. minibatches, for each epoch
    for _epoch in range(config.epochs):
        for minibatch in parts:
            datums = batch_to_datums(minibatch, with_mask=with_mask)
            if config.runs_custom_loss:
                loss_fn = as_custom_loss(spec, datums)

                def submit() -> Any:
                    return client.forward_backward_custom(forward_only(datums), loss_fn)
            else:

                def submit() -> Any:
                    return client.forward_backward(
                        datums, loss_fn=spec.name, loss_fn_config=loss_fn_config
                    )

            output = retry(run, lambda: submit().result(), "forward_backward")
            logprobs_N = output_logprobs(output.loss_fn_outputs)
            # 9. the kernel's metrics and ratio statistics from the returned log-probs
            metrics = update_metrics(spec, logprobs_N, minibatch)
            measured = measured or mismatch_row(logprobs_N, minibatch, staleness)
            if not math.isfinite(metrics["loss"]):
                state.weights_dirty = True  # the weights that gave this loss are not checkpointed
                raise NonFiniteUpdate(
                    f"the loss of update {len(collected) + 1} is {metrics['loss']}: the trainer's "
                    "log-probs are not finite (diverged weights?); lower --learning-rate"
                )
            state.weights_dirty = True
            retry(run, lambda: client.optim_step(run.adam).result(), "optim_step")
            fault_point("optim")
            collected.append(metrics)
    state.usage += training_usage(
        parts, passes=config.epochs, extra_forward=runs_extra_forward(config)
    )
    state.probe_datums = forward_only(datums)
    averaged = {key: float(np.mean([m[key] for m in collected])) for key in collected[0]}
    averaged["ratio/max_abs_log"] = max(m["ratio/max_abs_log"] for m in collected)
    averaged["optim_steps"] = float(len(collected))
    return {**averaged, **measured, **reshaped}


def submit_teacher(run: Run, problems: list[Problem], completions_P: Any) -> Any:
    """Distillation's step 2b: the teacher scoring of every completion, submitted (or None)."""
    if run.teacher is None:
        return None
    from grpo.training.distill import TeacherScoring

    return TeacherScoring(
        run.teacher, problems, completions_P, max_retries=run.config.max_retries, log=run.note
    )


def teacher_logprobs(
    state: RunState, scoring: Any, batch: TokenBatch, metrics: dict[str, float]
) -> np.ndarray:
    """q on the batch's completion positions; its time and usage into the step's row."""
    teacher_N = scoring.result_N(batch)
    metrics["time/teacher"] = scoring.seconds()
    metrics["usage/teacher_prompt_tokens"] = float(scoring.num_tokens())
    state.usage += scoring.usage()
    return teacher_N


def distill_now(
    batch: TokenBatch, teacher_N: np.ndarray, config: TrainConfig, metrics: dict[str, float]
) -> tuple[TokenBatch, Any]:
    """The distilled batch now (s = the sampler's), or a hook for the update (s = trainer's)."""
    from grpo.training.distill import distill_batch, in_update

    if in_update(config):
        return batch, lambda corrected: distill_batch(corrected, teacher_N, config)
    batch, found = distill_batch(batch, teacher_N, config)
    metrics.update(found)
    return batch, None


def mismatch_row(
    trainer_logprobs_N: np.ndarray, batch: TokenBatch, staleness: int
) -> dict[str, float]:
    """The mismatch metrics of the trainer's log-probs vs the batch's sampler log-probs.

    ``mismatch/*`` when the rollouts are fresh (pure sampler-trainer mismatch);
    ``mismatch_and_staleness/*`` when they are ``staleness`` > 0 updates old, since the
    trainer has then moved away from the weights that sampled.
    """
    prefix = "mismatch" if staleness == 0 else "mismatch_and_staleness"
    found = mismatch_metrics(
        trainer_logprobs_N, batch.sampling_logprobs, batch.mask, batch.seq_lens
    )
    return {f"{prefix}/{key}": value for key, value in found.items()}


def correct_for_mismatch(
    run: Run, batch: TokenBatch, staleness: int
) -> tuple[TokenBatch, dict[str, float]]:
    """Under --mismatch-correction: one forward for lp_prox, the batch corrected, its metrics.

    Without a correction, the batch unchanged and no metrics (the first update measures).
    """
    correction = run.config.mismatch
    if not correction.enabled:
        return batch, {}
    measured: dict[str, float] = {}
    with timed("time/proximal_forward", measured):
        output = retry(
            run,
            lambda: run.training_client.forward(
                forward_only(batch_to_datums(batch)), loss_fn="cross_entropy"
            ).result(),
            "forward (proximal log-probs)",
        )
        proximal_N = output_logprobs(output.loss_fn_outputs)
        if not np.isfinite(proximal_N[np.asarray(batch.mask, dtype=bool)]).all():
            raise NonFiniteUpdate(
                "the trainer's log-probs at the step's start are not finite (diverged weights?); "
                "lower --learning-rate"
            )
        corrected, found = correct_batch(batch, proximal_N, correction)
        measured.update(mismatch_row(proximal_N, batch, staleness))
        measured.update({f"mismatch_correction/{key}": value for key, value in found.items()})
    return corrected, measured


def retry(run: Run, call: Callable[[], Any], what: str) -> Any:
    """``call()`` with the run's retries of transient backend errors (--max-retries)."""
    return call_with_retries(call, what=what, max_retries=run.config.max_retries, on_retry=run.note)


def evaluate_now(run: Run, state: RunState) -> dict[str, float]:
    """Test accuracy of the current weights (one sample per problem at the run's temperature)."""
    config = run.config
    fault_point("eval")
    if config.env is not None:  # --env: one episode per test problem
        from grpo.training.episodes import evaluate_episodes

        metrics, usage = evaluate_episodes(run, current_sampler(run, state))
        state.usage += usage
        return metrics
    metrics, usage = evaluate(
        run.pool,
        current_sampler(run, state),
        run.test_problems,
        run.tokenizer,
        num_samples=1,
        temperature=config.temperature,
        max_tokens=config.max_tokens,
        seed=config.seed,
        max_retries=config.max_retries,
        log=run.note,
    )
    state.usage += usage
    return metrics


def log_step(
    run: Run, state: RunState, step: int, metrics: dict[str, float], write: Callable[[str], None]
) -> None:
    """Step 10's row to disk (durable), then the console; the weights are now ``step``'s."""
    fault_point("log")
    logged = state.usage_logged + state.usage
    metrics.update(usage_metrics(state.usage, logged, run.prices))
    run.logger.log(step, metrics, rollouts=state.rollout_log)
    state.rollout_log = []
    state.usage, state.usage_logged = TokenUsage(), logged
    state.completed, state.weights_dirty, state.last_metrics = step, False, metrics
    write(console_line(step, run.steps, metrics))


def checkpoint_check_usage(state: RunState) -> TokenUsage:
    """The forward-only positions of the check `save_checkpoint` runs (none before any update).

    Counted into the row of the step it checks, before the call, so a resumed run logs what
    an uninterrupted one does (a checkpoint taken on a stop signal is not counted).
    """
    probe = state.probe_datums or []
    return TokenUsage(forward_tokens=sum(len(datum.model_input) for datum in probe))


def _weights_give_finite_logprobs(run: Run, probe_datums: Any) -> bool:
    """One forward of ``probe_datums``: are the log-probs finite? (A backend that refuses
    non-finite log-probs itself, as the local one does, answers with a ``non_finite`` error.)"""
    try:
        probe = retry(
            run,
            lambda: run.training_client.forward(probe_datums, loss_fn="cross_entropy").result(),
            "forward (checkpoint check)",
        )
    except Exception as error:
        if "non_finite" in str(getattr(error, "code", "")):
            return False
        raise
    return bool(np.isfinite(output_logprobs(probe.loss_fn_outputs)).all())


def save_checkpoint(run: Run, state: RunState, name: str) -> None:
    """A resumable checkpoint of the weights of step ``state.completed``, if they are sound.

    One forward of the last minibatch first: weights that give non-finite log-probs (a
    diverged update) are never saved as resumable (NonFiniteUpdate instead).
    """
    if state.probe_datums is not None and not _weights_give_finite_logprobs(
        run, state.probe_datums
    ):
        state.weights_dirty = True
        raise NonFiniteUpdate(
            f"the weights after step {state.completed} give non-finite log-probs (a diverged "
            f"update); they are not checkpointed, the last good checkpoint is step "
            f"{state.last_saved_step}; lower --learning-rate"
        )
    result = retry(run, lambda: run.training_client.save_state(name).result(), "save_state")
    fault_point("save")
    if run.config.max_steps_off_policy:  # the rollouts sampled ahead go with the weights
        save_ahead(run.run_dir, state.completed, result.path, state.jobs, state.version)
    run_files.write_checkpoint(
        run.run_dir,
        run_files.Checkpoint(step=state.completed, state_path=result.path),
        run_name=run.config.run_name or run.run_dir.name,
    )
    if run.config.max_steps_off_policy:  # the previous checkpoint's file is not needed now
        prune_ahead(run.run_dir, state.completed)
    state.last_saved_step = state.completed
