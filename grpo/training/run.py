"""A training run's lifecycle: the run directory, resume, the step loop, stops, the summary.

`train` locks the run directory, checks it (a fresh run refuses one that holds a run; a
resume loads the checkpoint and drops the rows after it), runs the pre-flight
(`grpo.training.plan.preflight`), then the steps of `grpo.training.step` from the first one not
logged. SIGINT/SIGTERM stop it between steps, and any stop saves a resumable checkpoint
of the last logged step when the weights are still that step's. A finished run leaves
summary.json with its usage and, with prices, its cost. `dry_run` is the same checks and
the plan, with nothing written.

Reproducibility: every random choice is a pure function of (seed, step, index), so a run
stopped at step k and resumed from its checkpoint continues exactly as if never stopped
(under --max-steps-off-policy, the rollouts in flight are saved with the checkpoint:
`grpo.training.ahead`).
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
from pytrio.types import AdamParams

from grpo.backends.pytrio import make_service_client
from grpo.core.usage import Prices, TokenUsage, cost, usage_from_row
from grpo.envs.base import stop_env_calls_on
from grpo.reward_calls import reward_session
from grpo.training import run_files
from grpo.training.ahead import load_ahead
from grpo.training.config import ConfigError, TrainConfig, resolve_run, to_dict
from grpo.training.init_from import init_state_path, init_training_client
from grpo.training.logging import RunLogger, scrub_secrets
from grpo.training.plan import describe, plan_usage, preflight
from grpo.training.schedule import evaluates_at_start
from grpo.training.state import Run, RunState
from grpo.training.step import (
    NonFiniteUpdate,
    evaluate_now,
    log_step,
    retry,
    run_step,
    save_checkpoint,
)
from grpo.training.timing import timed

__all__ = ["ConfigError", "NonFiniteUpdate", "RunResult", "RunStopped", "dry_run", "train"]


class RunStopped(Exception):
    """The run stopped early (signal or failure) after saving what could be saved."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@attrs.frozen
class RunResult:
    """What a finished run leaves: its directory, last metrics, final sampler path."""

    run_dir: Path
    steps: int
    final_metrics: dict[str, float]
    sampler_path: str | None


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
    if checkpoint is None and config.init_from is not None:
        init_state_path(config)
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
        threads=config.threads,
        service_normalization=config.service_normalization,
    )


def check_run_status(run_dir: Path, resume: bool, command: str) -> str | None:
    """`run_dir`'s status when resuming (None: a fresh run), after refusing a fresh run into
    a used directory or a resume of a directory that holds no run; `command` names the CLI
    command (`grpo train`, `grpo sft`) in the error's fix."""
    status = run_files.run_status(run_dir)
    if not resume:
        if status != run_files.NEW:
            raise ConfigError(
                f"{run_dir} already holds a run ({status}); resume it with `grpo {command} "
                f"--resume {run_dir}`, or start elsewhere with --run-name / --run-dir"
            )
        return None
    if status == run_files.NEW:
        raise ConfigError(f"--resume {run_dir}: not a run directory (no {run_files.CONFIG_FILE})")
    return status


def _check_run_dir(
    run_dir: Path, config: TrainConfig, resume: bool
) -> run_files.Checkpoint | None | bool:
    """The checkpoint to resume from (None: from scratch), or False when there is nothing to do."""
    if check_run_status(run_dir, resume, "train") is None:
        return None
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
    init_path = init_state_path(config) if checkpoint is None and config.init_from else None
    pre = preflight(config, lambda: service_client or _make_service(config, run_dir))
    service, steps = pre.service, pre.steps

    def note(message: str) -> None:
        echo(f"[grpo] {message}")

    warning = sampling_mismatch_note(config)
    if warning is not None and config.mismatch.mode != "recompute":
        note(warning)
    if pre.teacher is not None:
        from grpo.training.distill import sampling_note

        distill_warning = sampling_note(config)
        if distill_warning is not None:
            note(distill_warning)
    probe = normalization_probe(config, service, note)
    if checkpoint is not None:
        training_client, checkpoint = _load_checkpoint(service, run_dir, checkpoint, note)
    elif init_path is not None:
        training_client = init_training_client(service, config, init_path)
    else:
        training_client = service.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        )
    start_step = checkpoint.step if checkpoint is not None else 0
    # Every check has passed: only now does the directory become (or continue as) a run.
    dropped = run_files.prepare_metrics_for_resume(run_dir, checkpoint.step if checkpoint else None)
    run_files.prepare_rollouts_for_resume(run_dir, checkpoint.step if checkpoint else None)
    if checkpoint is not None and checkpoint != run_files.read_checkpoint(run_dir):
        # The fallback becomes the run's checkpoint (a later stop does not look for it again).
        run_name = config.run_name or run_dir.name
        run_files.write_checkpoint(run_dir, checkpoint, run_name=str(run_name))
    if dropped:
        note(f"resuming at step {start_step}: {dropped} logged row(s) after it will be redone")
    (run_dir / run_files.SUMMARY_FILE).unlink(missing_ok=True)
    run_files.write_json_atomic(run_dir / run_files.CONFIG_FILE, scrub_secrets(to_dict(config)))
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
        teacher=pre.teacher,
    )
    state = RunState(
        completed=start_step,
        last_saved_step=start_step,
        version=start_step,
        usage_logged=logged_usage(run_dir, start_step),
    )
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
    return _run_steps(run, state, echo, progress)


def normalization_probe(
    config: TrainConfig, service: Any, note: Callable[[str], None]
) -> dict[str, Any] | None:
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


def _load_checkpoint(
    service: Any, run_dir: Path, checkpoint: run_files.Checkpoint, note: Callable[[str], None]
) -> tuple[Any, run_files.Checkpoint]:
    """The training client of the run's checkpoint and the checkpoint it came from.

    When the recorded one cannot be loaded (its files deleted), the newest intact earlier
    checkpoint on disk is used, with a message; if none loads, a ConfigError saying what to do.
    """
    try:
        return service.create_training_client_from_state_with_optimizer(
            checkpoint.state_path
        ), checkpoint
    except Exception as error:  # noqa: BLE001 - every backend has its own not-found error
        failure = error
    # PyTRIO's own hint would make the CLI drop the fix below (it keeps the text before it).
    reason = str(failure).split(" | Hint:")[0]
    earlier = [
        candidate
        for candidate in run_files.intact_checkpoints(run_dir)
        if candidate.step <= checkpoint.step and candidate.state_path != checkpoint.state_path
    ]
    for candidate in reversed(earlier):
        try:
            client = service.create_training_client_from_state_with_optimizer(candidate.state_path)
        except Exception:  # noqa: BLE001 - try the next older one
            continue
        note(
            f"the checkpoint of step {checkpoint.step} ({checkpoint.state_path}) cannot be "
            f"loaded ({reason}); resuming from step {candidate.step}, the newest intact "
            f"checkpoint ({candidate.state_path}): steps {candidate.step + 1}.."
            f"{checkpoint.step} are redone"
        )
        return client, candidate
    raise ConfigError(
        f"--resume {run_dir}: the checkpoint of step {checkpoint.step} "
        f"({checkpoint.state_path}) cannot be loaded: {reason}; no intact earlier checkpoint "
        f"was found. Restore it (the local backend keeps it under "
        f"{run_dir / run_files.BACKEND_DIR}), or delete "
        f"{run_dir / run_files.CHECKPOINT_FILE} and "
        f"{run_dir / run_files.METRICS_FILE} to rerun from the start"
    ) from failure


def _run_steps(run: Run, state: RunState, echo: Callable[[str], None], progress: bool) -> RunResult:
    from tqdm import tqdm

    bar = tqdm(
        total=run.steps,
        initial=state.completed,
        desc="grpo",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    write = bar.write if progress else echo
    clock: dict[str, float] = {}
    with timed("wall_time_s", clock):
        try:
            with (
                stop_on_signals() as stop_requested,
                stop_env_calls_on(stop_requested),
                reward_session(
                    run.config.reward_fns,
                    workers=run.config.reward_workers,
                    timeout=run.config.reward_timeout,
                    stop=stop_requested,
                    note=run.note,
                ),
            ):
                sampler_path = _steps_then_final_save(run, state, stop_requested, bar, write)
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
            if run.teacher is not None:
                run.teacher.close()
            bar.close()
            run.logger.close()

    wall_time = clock["wall_time_s"]
    run_files.write_json_atomic(
        run.run_dir / run_files.SUMMARY_FILE,
        {
            "finished": True,
            "steps": run.steps,
            "wall_time_s": wall_time,
            "final": state.last_metrics,
            "test/reward": state.last_metrics.get("test/reward"),
            **run_files.summary_sampler_path(run.run_dir, sampler_path),
            "run_name": run.config.run_name,
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


def _steps_then_final_save(
    run: Run,
    state: RunState,
    stop_requested: threading.Event,
    bar: Any,
    write: Callable[[str], None],
) -> str:
    """The baseline evaluation, every step not yet logged, the final checkpoint and weights."""
    if evaluates_at_start(run.config, state.completed):
        baseline = evaluate_now(run, state)
        if run.teacher is not None:  # distillation: the teacher's own test reward, once
            from grpo.training.distill import teacher_test_metrics

            found, usage = teacher_test_metrics(run, run.teacher)
            baseline.update(found)
            state.usage += usage
        log_step(run, state, 0, baseline, write)
    for step in range(state.completed, run.steps):
        if stop_requested.is_set():
            raise KeyboardInterrupt
        run_step(run, state, step, write)
        bar.update(1)
    save_checkpoint(run, state, "final")
    return retry(
        run,
        lambda: run.training_client.save_weights_for_sampler(
            sampler_weights_name(str(run.config.run_name))
        ).result(),
        "save_weights_for_sampler",
    ).path


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
