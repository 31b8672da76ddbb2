"""The GRPO training loop: the article's ten steps, top to bottom.

A step (``train_step``): pick a batch of problems -> sample a group per prompt from the
sampler of the current weights -> grade -> group advantages -> drop degenerate groups ->
pack the token batch (+ KL shaping) -> update (minibatches x epochs, one optimizer step
per minibatch) -> log. Sampling, grading and evaluation live in ``grpo.train.rollouts``; the
maths in ``grpo.core``; the run directory's files in ``grpo.train.run_files``.

The same code drives the PyTRIO service and the embedded local backend: only the service
client differs. With ``max_steps_off_policy = K > 0``, sampling for the next K steps is
submitted before this step trains, and a rollout is never used more than K updates stale.

Reproducibility: every random choice is a pure function of (seed, step, index), so a run
stopped at step k and resumed from its checkpoint continues exactly as if never stopped
(strictly on-policy runs; an off-policy pipeline re-samples what was in flight).

Durability: a step's row reaches disk before any checkpoint that covers it, and a
checkpoint is only taken of weights whose step has been logged, so a checkpoint never
points past the last complete row and no row is logged twice (docs/RELIABILITY.md).
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from pytrio.types import AdamParams, SamplingParams

from grpo.backends.datums import batch_to_datums, forward_only, output_logprobs
from grpo.backends.pytrio import call_with_retries, make_service_client
from grpo.core.advantages import kl_shaped_advantages
from grpo.core.alignment import mask_sequences, minibatches, pack_groups, truncated_sequences
from grpo.core.metrics import batch_metrics, mismatch_metrics, rollout_metrics, update_metrics
from grpo.core.mismatch import correct_batch
from grpo.core.records import TokenBatch
from grpo.core.usage import (
    Prices,
    TokenUsage,
    cost,
    reference_usage,
    training_usage,
    usage_from_row,
    usage_metrics,
)
from grpo.train import run_files
from grpo.train.config import ConfigError, TrainConfig, resolve_run, to_dict
from grpo.train.custom_loss import as_custom_loss
from grpo.train.logging import RunLogger, console_line, scrub_secrets
from grpo.train.plan import describe, plan_usage, preflight
from grpo.train.rollouts import (
    Problem,
    RolloutJob,
    StepRollouts,
    evaluate,
    extra_batch,
    extra_sampling_seed,
    grade_rollouts,
    pick_batch,
    reference_logprobs,
    refill,
    rollout_records,
    sampling_seed,
    score_groups,
    trainable_groups,
)

__all__ = ["ConfigError", "NonFiniteUpdate", "RunResult", "RunStopped", "train"]


class RunStopped(Exception):
    """The run stopped early (signal or failure) after saving what could be saved."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class NonFiniteUpdate(RuntimeError):
    """An update whose loss or log-probs are not finite; raised before its optimizer step."""


@attrs.frozen
class RunResult:
    """What a finished run leaves: its directory, last metrics, final sampler path."""

    run_dir: Path
    steps: int
    final_metrics: dict[str, float]
    sampler_path: str | None


@attrs.frozen
class Run:
    """What stays fixed during a run: the config, clients, problems and sinks."""

    config: TrainConfig
    run_dir: Path
    steps: int
    training_client: Any
    tokenizer: Any
    train_problems: list[Problem]
    test_problems: list[Problem]
    adam: AdamParams
    pool: ThreadPoolExecutor
    ref_sampler: Any
    logger: RunLogger
    note: Callable[[str], None]
    prices: Prices | None = None


@attrs.define
class RunState:
    """What changes during a run: progress, the sampler cache and in-flight rollouts."""

    completed: int
    """The last step whose row is on disk (the step a checkpoint of these weights covers)."""
    last_saved_step: int
    version: int
    """Updates applied, at batch granularity: one per trained step."""
    weights_dirty: bool = False
    """True from the first optimizer step of a step until its row is logged."""
    probe_datums: Any = None
    """The last minibatch, stripped to targets: no checkpoint if its log-probs are not finite."""
    sampler: Any = None
    sampler_version: int = -1
    jobs: dict[int, RolloutJob] = attrs.Factory(dict)
    rollout_log: list[dict[str, Any]] = attrs.Factory(list)
    """The groups of the step being trained, for rollouts.jsonl (written with its row)."""
    last_metrics: dict[str, float] = attrs.Factory(dict)
    usage: TokenUsage = TokenUsage()
    """Tokens used since the last logged row (they go into the next one)."""
    usage_logged: TokenUsage = TokenUsage()
    """Tokens of every logged row, cumulative (``usage/cum_*`` of the last row)."""


FAULT_ENV = "GRPO_FAULT_POINT"
"""Fault injection for tests: ``<point>:<n>:<SIGNAL>`` sends SIGNAL to this process at the
n-th pass (from 1) of the named point, e.g. ``save:2:SIGKILL``. Unset, it costs one lookup."""

_fault_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    """A named place where the fault-injection suite may signal the run (see FAULT_ENV)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, count, signal_name = spec.split(":")
    if point != name:
        return
    _fault_passes[name] = _fault_passes.get(name, 0) + 1
    if _fault_passes[name] == int(count):
        for _ in range(2 if signal_name == "SIGINT2" else 1):
            os.kill(os.getpid(), getattr(signal, signal_name.rstrip("2")))


# --- the ten steps ---------------------------------------------------------------------------


def train_step(run: Run, state: RunState, step: int) -> dict[str, float]:
    """One training step (steps 1-9 of the article); returns its metrics, not yet logged."""
    config = run.config
    step_start = time.perf_counter()
    submit_rollouts(run, state, step)  # 1-3: pick problems, build prompts, sample (async)
    job = state.jobs.pop(step)
    staleness = state.version - job.sampler_version
    if staleness > config.max_steps_off_policy:
        raise AssertionError(
            f"rollouts {staleness} steps stale > --max-steps-off-policy "
            f"{config.max_steps_off_policy}"
        )
    completions_P = job.result()  # 4: a group per prompt
    state.usage += job.usage()
    fault_point("sampled")
    sample_time = time.perf_counter() - step_start
    rollouts = grade_rollouts(job.problems, completions_P, config)  # 5: grade (--reward)
    if config.dynamic_sampling:  # DAPO: sample more prompts until batch_size groups can train
        rollouts = refill(
            rollouts,
            needed=config.batch_size,
            max_rounds=config.max_sampling_rounds,
            sample_round=lambda round_: sample_extra_round(run, state, step, round_),
        )
    groups_P = score_groups(  # 6: group advantages
        rollouts.problems_P, rollouts.completions_P, rollouts.scores.totals_P, config.advantage
    )
    metrics = {
        **rollout_metrics(groups_P),
        **rollouts.scores.metrics(),
        "off_policy_steps": float(staleness),
    }
    limit = config.batch_size if config.dynamic_sampling else None
    trainable_P = trainable_groups(groups_P, limit)  # 7: drop degenerate groups
    if config.dynamic_sampling:
        metrics.update(sampling_metrics(rollouts, trainable_P))
    state.rollout_log = rollout_records(rollouts, groups_P, run.tokenizer, config.log_rollouts)
    train_start = time.perf_counter()
    batch = pack_groups(trainable_P, drop_degenerate=False)  # 8: the token batch
    if config.mask_truncated:  # DAPO: truncated completions train no tokens
        batch = mask_sequences(batch, truncated_sequences(trainable_P))
    if batch.num_train_tokens:
        if run.ref_sampler is not None:
            ref_logprobs_N = reference_logprobs(
                run.pool, run.ref_sampler, trainable_P, config.max_retries, run.note
            )
            batch, metrics["kl"] = shape_with_kl(batch, ref_logprobs_N, config)
            state.usage += reference_usage(trainable_P)
        metrics.update(batch_metrics(batch))
        metrics.update(update(run, state, batch, staleness))  # 9: minibatches x epochs of updates
        state.version += 1
    else:
        metrics.update(batch_metrics(batch))
    metrics["time/sample"] = sample_time
    metrics["time/train"] = time.perf_counter() - train_start
    return metrics


def submit_rollouts(run: Run, state: RunState, step: int) -> None:
    """Submit the sampling of steps ``step`` .. ``step + K`` not yet in flight (K = off-policy)."""
    config = run.config
    last = min(step + config.max_steps_off_policy, run.steps - 1)
    for ahead in range(step, last + 1):
        if ahead in state.jobs:
            continue
        indices = pick_batch(len(run.train_problems), config.batch_size, ahead, config.seed)
        state.jobs[ahead] = RolloutJob(
            run.pool,
            current_sampler(run, state),
            [run.train_problems[index] for index in indices],
            params_for=_sampling_params(config, ahead),
            num_samples=config.group_size,
            tokenizer=run.tokenizer,
            max_retries=config.max_retries,
            log=run.note,
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
    job = RolloutJob(
        run.pool,
        current_sampler(run, state),
        problems,
        params_for=_sampling_params(config, step, round_),
        num_samples=config.group_size,
        tokenizer=run.tokenizer,
        max_retries=config.max_retries,
        log=run.note,
        sampler_version=state.version,
    )
    return grade_rollouts(problems, job.result(), config)


def sampling_metrics(rollouts: StepRollouts, trainable_P: list[Any]) -> dict[str, float]:
    """Dynamic sampling's cost and result: rounds, extra completion tokens, groups that train."""
    return {
        "sampling/rounds": float(rollouts.rounds),
        "sampling/extra_tokens": float(rollouts.extra_tokens),
        "sampling/groups": float(len(trainable_P)),
    }


def sampling_mismatch_note(config: TrainConfig) -> str | None:
    """Start-up warning when the sampled distribution is not the trainer's (T ≠ 1, top-p < 1)."""
    if config.temperature == 1.0 and config.top_p == 1.0:
        return None
    return (
        f"sampling at temperature {config.temperature:g}, top-p {config.top_p:g}: the local "
        "sampler's log-probs are those of that tempered, filtered distribution, the trainer's "
        "of the temperature-1 softmax, so the importance ratio starts away from 1 (logged as "
        "mismatch/kl_k3); --mismatch-correction recompute trains against the trainer's own "
        "log-probs instead, token_truncate / token_mask bound the weight (docs/FORMULAS.md)"
    )


def current_sampler(run: Run, state: RunState) -> Any:
    """A sampling client on the current weights, refreshed once per update."""
    if state.sampler_version != state.version:
        state.sampler = call_with_retries(
            run.training_client.save_weights_and_get_sampling_client,
            what="save_weights_and_get_sampling_client",
            max_retries=run.config.max_retries,
            on_retry=run.note,
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


def update(run: Run, state: RunState, batch: TokenBatch, staleness: int = 0) -> dict[str, float]:
    """Epochs x minibatches of forward_backward + optim_step; metrics averaged over them.

    ``ratio/max_abs_log`` is the maximum over the updates. Each update's loss is checked
    finite before its optimizer step, so non-finite numbers never reach the weights. The
    mismatch metrics come from the trainer's log-probs before the step's first update (the
    first minibatch's, or the proximal forward's when a correction is on).
    """
    config, client, spec = run.config, run.training_client, run.config.loss_spec
    loss_fn_config = spec.to_loss_fn_config()
    collected: list[dict[str, float]] = []
    batch, measured = correct_for_mismatch(run, batch, staleness)
    if config.mismatch.enabled:  # the proximal forward: once a step, every position
        state.usage += TokenUsage(forward_tokens=batch.num_tokens)
    with_mask = config.mismatch.enabled and spec.reduction != "sum"
    parts = minibatches(batch, config.num_substeps)
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

            output = _retry(run, lambda: submit().result(), "forward_backward")
            logprobs_N = output_logprobs(output.loss_fn_outputs)
            metrics = update_metrics(spec, logprobs_N, minibatch)
            measured = measured or mismatch_row(logprobs_N, minibatch, staleness)
            if not math.isfinite(metrics["loss"]):
                state.weights_dirty = True  # the weights that gave this loss are not checkpointed
                raise NonFiniteUpdate(
                    f"the loss of update {len(collected) + 1} is {metrics['loss']}: the trainer's "
                    "log-probs are not finite (diverged weights?); lower --learning-rate"
                )
            state.weights_dirty = True
            _retry(run, lambda: client.optim_step(run.adam).result(), "optim_step")
            fault_point("optim")
            collected.append(metrics)
    state.usage += training_usage(parts, passes=config.epochs, extra_forward=_extra_forward(config))
    state.probe_datums = forward_only(datums)
    averaged = {key: float(np.mean([m[key] for m in collected])) for key in collected[0]}
    averaged["ratio/max_abs_log"] = max(m["ratio/max_abs_log"] for m in collected)
    averaged["optim_steps"] = float(len(collected))
    return {**averaged, **measured}


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
    start = time.perf_counter()
    output = _retry(
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
    return corrected, {
        **mismatch_row(proximal_N, batch, staleness),
        **{f"mismatch_correction/{key}": value for key, value in found.items()},
        "time/proximal_forward": time.perf_counter() - start,
    }


def _extra_forward(config: TrainConfig) -> bool:
    """PyTRIO's SDK runs a custom loss as a forward, then a forward_backward (one pass locally)."""
    return config.runs_custom_loss and config.backend == "pytrio"


def _retry(run: Run, call: Callable[[], Any], what: str) -> Any:
    return call_with_retries(call, what=what, max_retries=run.config.max_retries, on_retry=run.note)


def evaluate_now(run: Run, state: RunState) -> dict[str, float]:
    """Test accuracy of the current weights (one sample per problem at the run's temperature)."""
    config = run.config
    fault_point("eval")
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
    """Step 10: the row to disk (durable), then the console; the weights are now ``step``'s."""
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
        probe = _retry(
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
    result = _retry(run, lambda: run.training_client.save_state(name).result(), "save_state")
    fault_point("save")
    run_files.write_checkpoint(
        run.run_dir,
        run_files.Checkpoint(step=state.completed, state_path=result.path),
        run_name=run.config.run_name or run.run_dir.name,
    )
    state.last_saved_step = state.completed


# --- the run ----------------------------------------------------------------------------------


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    service_client: Any = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> RunResult:
    """Run GRPO for ``config.steps`` steps (or continue a run directory with ``resume=True``).

    The run directory is locked for the whole run; a fresh run refuses a directory that
    already holds one, and resuming a finished run changes nothing unless more steps are asked.
    """
    config = resolve_run(config)
    run_dir = Path(str(config.run_dir))
    with run_files.owned(run_dir):
        checkpoint = _check_run_dir(run_dir, config, resume)
        if checkpoint is False:
            return _finished_result(run_dir, echo)
        return _train_in(run_dir, config, checkpoint, service_client, echo, progress)


def dry_run(config: TrainConfig, *, resume: bool = False, service_client: Any = None) -> list[str]:
    """`grpo train --dry-run`: the checks a run does before its first call, then its plan.

    No training client is created and nothing is written (no run directory, no lock).
    """
    config = resolve_run(config)
    run_dir = Path(str(config.run_dir))
    checkpoint = _check_run_dir(run_dir, config, resume)
    if checkpoint is False:
        return [f"{run_dir} already finished its steps; nothing to plan"]
    start_step = checkpoint.step if checkpoint is not None else 0
    service = service_client or _make_service(config, run_dir)
    try:
        pre = preflight(config, lambda: service)
        return describe(pre, plan_usage(pre, start_step), start_step)
    finally:
        if service_client is None and hasattr(service, "close"):
            service.close()


def _make_service(config: TrainConfig, run_dir: Path) -> Any:
    return make_service_client(
        config.backend,
        local_root=str(run_dir / run_files.BACKEND_DIR),
        seed=config.seed,
        connect_timeout_s=config.connect_timeout,
        concurrency=config.concurrency,
        sampler_dtype=config.sampler_dtype,
    )


def _check_run_dir(
    run_dir: Path, config: TrainConfig, resume: bool
) -> run_files.Checkpoint | None | bool:
    """The checkpoint to resume from (None: from scratch), or False when there is nothing to do."""
    status = run_files.run_status(run_dir)
    if not resume:
        if status != run_files.NEW:
            raise ConfigError(
                f"{run_dir} already holds a run ({status}); resume it with `grpo train --resume "
                f"{run_dir}`, or start elsewhere with --run-name / --run-dir"
            )
        return None
    if status == run_files.NEW:
        raise ConfigError(f"--resume {run_dir}: not a run directory (no {run_files.CONFIG_FILE})")
    checkpoint = run_files.read_checkpoint(run_dir)
    summary = run_files.read_summary(run_dir)
    if summary is not None and not config.all_data and int(summary.get("steps", 0)) >= config.steps:
        return False
    return checkpoint


def _finished_result(run_dir: Path, echo: Callable[[str], None]) -> RunResult:
    summary = run_files.read_summary(run_dir) or {}
    steps = int(summary.get("steps", 0))
    echo(
        f"[grpo] {run_dir} already finished {steps} steps; nothing to do (pass --steps N with "
        "N larger to continue it)"
    )
    return RunResult(
        run_dir=run_dir,
        steps=steps,
        final_metrics=dict(summary.get("final", {})),
        sampler_path=summary.get("sampler_path"),
    )


def _train_in(
    run_dir: Path,
    config: TrainConfig,
    checkpoint: run_files.Checkpoint | None,
    service_client: Any,
    echo: Callable[[str], None],
    progress: bool,
) -> RunResult:
    start_step = checkpoint.step if checkpoint is not None else 0
    pre = preflight(config, lambda: service_client or _make_service(config, run_dir))
    service, steps = pre.service, pre.steps

    def note(message: str) -> None:
        echo(f"[grpo] {message}")

    warning = sampling_mismatch_note(config)
    if warning is not None and config.mismatch.mode != "recompute":
        note(warning)
    if checkpoint is not None:
        training_client = _load_checkpoint(service, run_dir, checkpoint)
    else:
        training_client = service.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        )
    # Every check has passed: only now does the directory become (or continue as) a run.
    dropped = run_files.prepare_metrics_for_resume(run_dir, checkpoint.step if checkpoint else None)
    run_files.prepare_rollouts_for_resume(run_dir, checkpoint.step if checkpoint else None)
    if dropped:
        note(f"resuming at step {start_step}: {dropped} logged row(s) after it will be redone")
    (run_dir / run_files.SUMMARY_FILE).unlink(missing_ok=True)
    run_files.write_json_atomic(run_dir / run_files.CONFIG_FILE, scrub_secrets(to_dict(config)))
    run = Run(
        config=config,
        run_dir=run_dir,
        steps=steps,
        training_client=training_client,
        tokenizer=pre.tokenizer,
        train_problems=pre.train_problems,
        test_problems=pre.test_problems,
        adam=AdamParams(
            learning_rate=config.learning_rate,
            beta1=config.beta1,
            beta2=config.beta2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            grad_clip_norm=config.grad_clip_norm,
        ),
        pool=ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="rollout"),
        ref_sampler=pre.base_sampler if config.kl_coef > 0 else None,
        logger=RunLogger(
            run_dir,
            config=to_dict(config),
            swanlab_mode=config.swanlab_mode,
            swanlab_project=config.swanlab_project,
            run_name=str(config.run_name),
        ),
        note=note,
        prices=pre.prices,
    )
    state = RunState(
        completed=start_step,
        last_saved_step=start_step,
        version=start_step,
        usage_logged=logged_usage(run_dir, start_step),
    )
    return _run_steps(run, state, echo, progress)


def _load_checkpoint(service: Any, run_dir: Path, checkpoint: run_files.Checkpoint) -> Any:
    """The training client of the run's checkpoint; a ConfigError saying what to do if gone."""
    try:
        return service.create_training_client_from_state_with_optimizer(checkpoint.state_path)
    except Exception as error:  # noqa: BLE001 - every backend has its own not-found error
        raise ConfigError(
            f"--resume {run_dir}: the checkpoint of step {checkpoint.step} "
            f"({checkpoint.state_path}) "
            f"cannot be loaded: {error}. Restore it (the local backend keeps it under "
            f"{run_dir / run_files.BACKEND_DIR}), or delete "
            f"{run_dir / run_files.CHECKPOINT_FILE} and "
            f"{run_dir / run_files.METRICS_FILE} to rerun from the start"
        ) from error


def _run_steps(run: Run, state: RunState, echo: Callable[[str], None], progress: bool) -> RunResult:
    from tqdm import tqdm

    config = run.config
    bar = tqdm(
        total=run.steps,
        initial=state.completed,
        desc="grpo",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    write = bar.write if progress else echo
    run_start = time.perf_counter()
    try:
        with stop_on_signals() as stop_requested:
            if config.eval_every and state.completed == 0:
                log_step(run, state, 0, evaluate_now(run, state), write)
            for step in range(state.completed, run.steps):
                if stop_requested.is_set():
                    raise KeyboardInterrupt
                step_start = time.perf_counter()
                metrics = train_step(run, state, step)
                done = step + 1
                if config.eval_every and (done % config.eval_every == 0 or done == run.steps):
                    metrics.update(evaluate_now(run, state))
                metrics["time/step"] = time.perf_counter() - step_start
                if done == run.steps or (config.save_every and done % config.save_every == 0):
                    state.usage += checkpoint_check_usage(state)  # logged with this row
                log_step(run, state, done, metrics, write)
                bar.update(1)
                if config.save_every and done % config.save_every == 0 and done < run.steps:
                    save_checkpoint(run, state, f"step-{done:06d}")
            save_checkpoint(run, state, "final")
            sampler_path = _retry(
                run,
                lambda: run.training_client.save_weights_for_sampler(
                    sampler_weights_name(str(config.run_name))
                ).result(),
                "save_weights_for_sampler",
            ).path
    except KeyboardInterrupt:
        _stop_with_checkpoint(run, state)
        raise RunStopped(
            f"stopped by signal after step {state.completed}; resume with "
            f"`grpo train --resume {run.run_dir}`",
            exit_code=130,
        ) from None
    except Exception as error:
        _stop_with_checkpoint(run, state)
        raise RunStopped(
            f"run failed at step {state.completed + 1}: {type(error).__name__}: {error}\n"
            f"resume with `grpo train --resume {run.run_dir}`",
            exit_code=1,
        ) from error
    finally:
        for pending in state.jobs.values():
            pending.cancel()
        run.pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        run.logger.close()

    wall_time = time.perf_counter() - run_start
    run_files.write_json_atomic(
        run.run_dir / run_files.SUMMARY_FILE,
        {
            "finished": True,
            "steps": run.steps,
            "wall_time_s": wall_time,
            "final": state.last_metrics,
            "test/reward": state.last_metrics.get("test/reward"),
            "sampler_path": sampler_path,
            "run_name": config.run_name,
            **usage_summary(state.usage_logged + state.usage, run.prices),
        },
    )
    echo(
        f"[grpo] done: {run.steps} steps in {wall_time:.1f}s; final sampler weights: {sampler_path}"
    )
    return RunResult(
        run_dir=run.run_dir,
        steps=run.steps,
        final_metrics=state.last_metrics,
        sampler_path=sampler_path,
    )


def logged_usage(run_dir: Path, step: int) -> TokenUsage:
    """The cumulative usage of the logged row of ``step`` (a resumed run continues from it)."""
    rows = [row for row in run_files.read_metrics(run_dir) if row[run_files.STEP_KEY] == step]
    return usage_from_row(rows[-1]) if rows else TokenUsage()


def usage_summary(usage: TokenUsage, prices: Prices | None) -> dict[str, Any]:
    """summary.json's ``usage`` (the last row's cumulative usage) and, with prices, ``cost``."""
    summary: dict[str, Any] = {"usage": attrs.asdict(usage)}
    if prices is not None:
        summary["cost"] = {
            "total": cost(usage, prices),
            "currency": prices.currency,
            "source": prices.source,
            "per_million": prices.per_kind(),
        }
    return summary


def sampler_weights_name(run_name: str) -> str:
    """The run name as a checkpoint name PyTRIO accepts: [A-Za-z0-9._-], alphanumeric ends.

    A sweep's run names hold '=' and ',' (``mismatch_correction=none-seed0``); they become '_'.
    """
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run_name).strip("._-")
    return name or "final"


def _stop_with_checkpoint(run: Run, state: RunState) -> None:
    """Save a resumable checkpoint at the last logged step, unless the weights moved past it."""
    if state.weights_dirty:
        run.note(
            f"stopped mid-step: keeping the checkpoint of step {state.last_saved_step} (the "
            "weights of a step whose row was not logged are not resumable)"
        )
        return
    if state.completed == state.last_saved_step:
        return
    try:
        save_checkpoint(run, state, f"step-{state.completed:06d}")
        run.note(f"checkpoint saved at step {state.completed}")
    except Exception as error:  # noqa: BLE001 - the original failure is what the user must see
        run.note(
            f"could not save a checkpoint ({type(error).__name__}: {error}); the last one is "
            f"step {state.last_saved_step}"
        )


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM set an event the loop checks between steps; a second SIGINT aborts at once."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum: int, _frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
