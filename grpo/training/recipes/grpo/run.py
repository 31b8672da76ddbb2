"""`grpo train` and `grpo distill`: a GRPO run on the shared lifecycle.

`train` locks the run directory and checks it (`grpo.training.run.lifecycle`), runs the
pre-flight (`grpo.training.recipes.grpo.plan.preflight`), builds the run's fixed record
(`Run`: clients, problems, sinks) and hands the GRPO recipe
(`grpo.training.recipes.grpo.recipe`) to the lifecycle, which takes the steps from the first
one not logged, stops on signals with a checkpoint and writes the summary. `dry_run` is the
same checks and the plan, with nothing written.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo.backends.clients import ServiceClient
from grpo.training.recipes.grpo.plan import describe, plan_usage, preflight
from grpo.training.recipes.grpo.recipe import GrpoRecipe
from grpo.training.run import run_files
from grpo.training.run.ahead import load_ahead
from grpo.training.run.init_from import init_state_path
from grpo.training.run.inputs import checked_run_dir
from grpo.training.run.lifecycle import (
    NonFiniteUpdate,
    RunResult,
    RunStopped,
    adam_params,
    check_run_status,
    close_opened,
    finished_result,
    open_run,
    open_training_client,
    run_divisor,
    run_service,
    run_steps,
    sampler_weights_name,
    start_state,
)
from grpo.training.run.run_log import RunLogger, scrub_secrets
from grpo.training.run.state import Run
from grpo.training.settings.config import ConfigError, TrainConfig, resolve_run, to_dict

__all__ = [
    "ConfigError",
    "NonFiniteUpdate",
    "RunResult",
    "RunStopped",
    "dry_run",
    "sampler_weights_name",
    "train",
]


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    service_client: ServiceClient | None = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> RunResult:
    """Run GRPO for ``config.steps`` steps (or continue a run directory with ``resume=True``).

    The run directory is locked for the whole run; a fresh run refuses a directory that
    already holds one, and resuming a finished run changes nothing unless more steps are asked.
    """
    config = resolve_run(config)
    run_dir = checked_run_dir(config)
    with run_files.owned(run_dir):
        checkpoint = _check_run_dir(run_dir, config, resume)
        if checkpoint is False:
            return finished_result(run_dir, echo, " (to continue it, resume with a larger --steps)")
        return _train_in(run_dir, config, checkpoint, service_client, echo, progress)


def dry_run(
    config: TrainConfig, *, resume: bool = False, service_client: ServiceClient | None = None
) -> list[str]:
    """`grpo train --dry-run`: the checks a run does before its first call, then its plan.

    No training client is created and nothing is written (no run directory, no lock).
    """
    config = resolve_run(config)
    run_dir = checked_run_dir(config)
    checkpoint = _check_run_dir(run_dir, config, resume)
    if checkpoint is False:
        return [f"{run_dir} already finished its steps; nothing to plan"]
    start_step = checkpoint.step if checkpoint is not None else 0
    if checkpoint is None and config.init_from is not None:
        init_state_path(config)
    service = service_client or run_service(config, run_dir)
    try:
        pre = preflight(config, lambda: service)
        return describe(pre, plan_usage(pre, start_step), start_step)
    finally:
        close_opened(service, service_client)


def _check_run_dir(
    run_dir: Path, config: TrainConfig, resume: bool
) -> run_files.Checkpoint | None | bool:
    """The checkpoint to resume from (None: from scratch), or False when there is nothing to do."""
    if check_run_status(run_dir, resume, "train", extend_flag="--steps N") is None:
        return None
    checkpoint = run_files.read_checkpoint(run_dir)
    summary = run_files.read_summary(run_dir)
    if summary is not None and not config.all_data and int(summary.get("steps", 0)) >= config.steps:
        return False
    return checkpoint


def _train_in(
    run_dir: Path,
    config: TrainConfig,
    checkpoint: run_files.Checkpoint | None,
    service_client: ServiceClient | None,
    echo: Callable[[str], None],
    progress: bool,
) -> RunResult:
    init_path = init_state_path(config) if checkpoint is None and config.init_from else None

    def note(message: str) -> None:
        echo(f"[grpo] {message}")

    pre = preflight(config, lambda: service_client or run_service(config, run_dir), note)
    service, steps = pre.service, pre.steps

    warning = sampling_mismatch_note(config)
    if warning is not None and config.mismatch.mode != "recompute":
        note(warning)
    if pre.teacher is not None:
        from grpo.training.recipes.distill.teacher import TEMPERED_DISTILLATION

        distill_warning = tempered_sampling_note(config, "distilling", TEMPERED_DISTILLATION)
        if distill_warning is not None:
            note(distill_warning)
    probe = normalization_probe(config, service, note)
    divisor = run_divisor(config, probe, note, service)
    training_client, checkpoint = open_training_client(
        service, config, run_dir, checkpoint, init_path, note
    )
    # Every check has passed: only now does the directory become (or continue as) a run.
    start_step = open_run(run_dir, checkpoint, scrub_secrets(to_dict(config)), note)
    if probe is not None:
        run_files.write_json_atomic(run_dir / run_files.PROBE_FILE, probe)
    run = Run(
        config=config,
        run_dir=run_dir,
        steps=steps,
        training_client=training_client,
        tokenizer=pre.tokenizer,
        train_problems=pre.train_problems,
        test_problems=pre.test_problems,
        adam=adam_params(config, config.learning_rate),
        pool=ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="rollout"),
        ref_sampler=pre.base_sampler if config.kl_coef > 0 else None,
        logger=RunLogger.of_run(run_dir, to_dict(config), config, start_step=start_step, note=note),
        note=note,
        prices=pre.prices,
        teacher=pre.teacher,
        judge=pre.judge,
        service_normalization=divisor.convention,
    )
    state = start_state(run_dir, start_step)
    if checkpoint is not None and config.max_steps_off_policy and start_step < steps:
        state.jobs.update(
            load_ahead(
                run_dir,
                start_step,
                checkpoint.state_path,
                problems=pre.train_problems,
                batch_size=config.batch_size,
                seed=config.seed,
                max_steps_off_policy=config.max_steps_off_policy,
                steps=steps,
                version=state.version,
                note=note,
            )
        )
    result = run_steps(GrpoRecipe(run), state, echo, progress)
    close_opened(service, service_client)
    return result


def normalization_probe(
    config: TrainConfig, service: ServiceClient, note: Callable[[str], None]
) -> run_files.JsonObject | None:
    """With --backend pytrio and --normalization-probe: the probe's record (service_probe.json),
    its verdict noted; a failure is noted and recorded, never raised; else None."""
    if config.backend != "pytrio" or not config.normalization_probe:
        return None
    from grpo.backends.normalization_probe import PROBE_LOSSES, probe_normalization

    builtin = config.loss_fn in PROBE_LOSSES and not config.runs_custom_loss
    loss_fn = config.loss_fn if builtin else "importance_sampling"
    try:
        result = probe_normalization(service, config.base_model, loss_fn=loss_fn, seed=config.seed)
    except Exception as error:  # noqa: BLE001 - the probe informs; it never stops the run
        reason = f"{type(error).__name__}: {error}"
        note(
            f"normalization probe failed: {reason}; continuing (--no-normalization-probe skips it)"
        )
        return {"convention": None, "loss_fn": loss_fn, "failed": reason}
    note(
        f"normalization probe ({loss_fn}, {result.calls} calls, {result.elapsed_s:.1f}s): the "
        f"service's gradient scale is {result.verdict.describe()}"
    )
    return result.to_record()


def tempered_sampling_note(config: TrainConfig, doing: str, consequence: str) -> str | None:
    """The start-up warning "``doing`` at temperature T, top-p p: ``consequence``" of a run
    that does not sample at T = 1, top-p 1; None for one that does."""
    if config.temperature == 1.0 and config.top_p == 1.0:
        return None
    return f"{doing} at temperature {config.temperature:g}, top-p {config.top_p:g}: {consequence}"


def sampling_mismatch_note(config: TrainConfig) -> str | None:
    """Start-up warning when the sampled distribution is not the trainer's (T ≠ 1, top-p < 1)."""
    return tempered_sampling_note(
        config,
        "sampling",
        "the local sampler's log-probs are those of that tempered, filtered distribution, "
        "the trainer's of the temperature-1 softmax, so the importance ratio starts away from 1 "
        "(logged as mismatch/kl_k3); --mismatch-correction recompute trains against the "
        "trainer's own log-probs instead, token_truncate / token_mask bound the weight "
        "(docs/FORMULAS.md)",
    )
