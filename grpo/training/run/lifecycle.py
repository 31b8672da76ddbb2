"""The run lifecycle, written once: it drives every recipe (GRPO, distillation, SFT).

A `Recipe` (`grpo.training.run.recipe`) says what one step does; this module does the rest:

- ``open_run``: the run directory's checks (a fresh run refuses a used directory; a resume
  needs one), the training client (from the checkpoint, falling back to the newest intact
  earlier one when it cannot be loaded), the metrics and rollouts after the checkpoint
  dropped, config.json written: only after every check has passed.
- ``run_steps``: the baseline row, each step not yet logged (its row on disk before any
  checkpoint that covers it), a checkpoint every --save-every steps and at the end (never
  of weights whose log-probs are not finite), the final sampler weights and summary.json.
  SIGINT/SIGTERM stop it between steps and any stop saves a resumable checkpoint of the
  last logged step when the weights are still that step's (docs/RELIABILITY.md).

Reproducibility: every random choice is a pure function (`grpo.training.run.seeds`), so a run
stopped at step k and resumed from its checkpoint continues as if never stopped.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, TypeVar

import attrs
import numpy as np
from pytrio.types import AdamParams, Datum

from grpo.backends.clients import ServiceClient, TrainingClient
from grpo.backends.datums import output_logprobs
from grpo.backends.pytrio import call_with_retries, error_reason, make_service_client
from grpo.core.normalization import LOCAL_TRAIN_NORMALIZATION, ServiceDivisor, service_divisor
from grpo.core.usage import Prices, TokenUsage, cost, usage_from_row, usage_metrics
from grpo.training.run import run_files
from grpo.training.run.faults import fault_point
from grpo.training.run.init_from import init_training_client
from grpo.training.run.recipe import Recipe, Session
from grpo.training.run.state import RunState
from grpo.training.run.timing import timed
from grpo.training.settings.config import FIELDS as TRAIN_FIELDS
from grpo.training.settings.config import ConfigError
from grpo.training.settings.config_groups import OptimizerSettings, RunConfig

if TYPE_CHECKING:
    from tqdm import tqdm

T = TypeVar("T")


class NonFiniteUpdate(RuntimeError):
    """An update whose loss or log-probs are not finite; raised before its optimizer step."""


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


# --- before the first step ---------------------------------------------------------------


def check_run_status(
    run_dir: Path, resume: bool, command: str, *, extend_flag: str | None = None
) -> str | None:
    """`run_dir`'s status when resuming (None: a fresh run), after refusing a fresh run into
    a used directory or a resume of a directory that holds no run; `command` names the CLI
    command (`grpo train`, `grpo sft`) in the error's fix, `extend_flag` the flag with which
    a resume continues a finished run (None: a finished run cannot be continued)."""
    status = run_files.run_status(run_dir)
    if not resume:
        if status == run_files.FINISHED:
            raise ConfigError(finished_run_message(run_dir, command, extend_flag))
        if status != run_files.NEW:
            raise ConfigError(
                f"{run_dir} already holds a run ({status}); resume it with `grpo {command} "
                f"--resume {run_dir}`, or start elsewhere with --run-name / --run-dir"
            )
        return None
    if status == run_files.NEW:
        raise ConfigError(f"--resume {run_dir}: not a run directory (no {run_files.CONFIG_FILE})")
    return status


def finished_run_message(run_dir: Path, command: str, extend_flag: str | None) -> str:
    """Why a fresh run cannot go into ``run_dir``, which holds a finished run, and what to do
    instead: a plain resume would do nothing, so it is suggested only with ``extend_flag``."""
    steps = int((run_files.read_summary(run_dir) or {}).get("steps", 0))
    extend = (
        f"continue it with `grpo {command} --resume {run_dir} {extend_flag}` (N above {steps}), "
        if extend_flag is not None
        else ""
    )
    return (
        f"{run_dir} already holds a finished run ({steps} steps, complete): evaluate it with "
        f"`grpo eval --run-dir {run_dir}`, {extend}or start a new run elsewhere with "
        "--run-name / --run-dir"
    )


def finished_result(run_dir: Path, echo: Callable[[str], None], hint: str) -> RunResult:
    """The result of resuming a run that already finished its steps: it is complete, nothing
    is done (``hint`` says how to continue it, when it can be)."""
    summary = run_files.read_summary(run_dir) or {}
    steps = int(summary.get("steps", 0))
    echo(f"[grpo] {run_dir} is complete: all {steps} steps are done; nothing to resume{hint}")
    return RunResult(
        run_dir=run_dir,
        steps=steps,
        final_metrics=dict(summary.get("final", {})),
        sampler_path=summary.get("sampler_path"),
    )


def run_service(config: RunConfig, run_dir: Path) -> ServiceClient:
    """The service client of any recipe's run, from its flags: the backend, seed, time-out,
    threads and divisor every recipe has, and --concurrency and --sampler-dtype where its
    config has them (else `grpo train`'s defaults); the local backend's files in the run's
    ``backend/``."""
    return make_service_client(
        config.backend,
        local_root=str(run_dir / run_files.BACKEND_DIR),
        seed=config.seed,
        connect_timeout_s=config.connect_timeout,
        concurrency=getattr(config, "concurrency", TRAIN_FIELDS["concurrency"].default),
        sampler_dtype=getattr(config, "sampler_dtype", TRAIN_FIELDS["sampler_dtype"].default),
        threads=config.threads,
        service_normalization=config.service_normalization or LOCAL_TRAIN_NORMALIZATION,
    )


def close_opened(service: ServiceClient, given: ServiceClient | None) -> None:
    """Close `service` when the run opened it (the caller gave none): a Tinker session ends
    with its run, not at the process's exit (its heartbeats failing meanwhile once the server
    is gone), a local worker stops. A run calls it when it is done, an error or a stop leaving
    it to the exit (`grpo.backends.tinker_sdk` finishes a Tinker session then); a dry run, with
    nothing in flight, after an error too."""
    if given is None and hasattr(service, "close"):
        service.close()


def open_training_client(
    service: ServiceClient,
    config: RunConfig,
    run_dir: Path,
    checkpoint: run_files.Checkpoint | None,
    init_state: str | None,
    note: Callable[[str], None],
) -> tuple[TrainingClient, run_files.Checkpoint | None]:
    """A run's training client: from its checkpoint (`load_checkpoint`, with the fallback),
    else on the ``init_state`` weights (--init-from), else a fresh LoRA of the config's base
    model, rank and seed; and the checkpoint it came from (None for the other two)."""
    if checkpoint is not None:
        return load_checkpoint(service, run_dir, checkpoint, note)
    if init_state is not None:
        return init_training_client(service, config, init_state), None
    client = service.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed
    )
    return client, None


def load_checkpoint(
    service: ServiceClient,
    run_dir: Path,
    checkpoint: run_files.Checkpoint,
    note: Callable[[str], None],
) -> tuple[TrainingClient, run_files.Checkpoint]:
    """The training client of the run's checkpoint and the checkpoint it came from.

    When the recorded one cannot be loaded (its files deleted or damaged), the newest intact
    earlier checkpoint on disk is used, with a message; if none loads, a ConfigError saying
    what to do.
    """
    try:
        return service.create_training_client_from_state_with_optimizer(
            checkpoint.state_path
        ), checkpoint
    except Exception as error:  # noqa: BLE001 - every backend has its own not-found error
        failure = error
    reason = error_reason(failure)  # pytrio's message alone: the fix is ours, below
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
    backend_dir = run_dir / run_files.BACKEND_DIR
    local = checkpoint.state_path.startswith(f"local://{backend_dir.resolve()}")
    keeper = (
        f"the local backend keeps it under {backend_dir}"
        if local
        else "it lives on the service that saved it"
    )
    raise ConfigError(
        f"--resume {run_dir}: the checkpoint of step {checkpoint.step} "
        f"({checkpoint.state_path}) cannot be loaded: {reason}; no intact earlier checkpoint "
        f"was found. Restore it ({keeper}), or delete "
        f"{run_dir / run_files.CHECKPOINT_FILE} and "
        f"{run_dir / run_files.METRICS_FILE} to rerun from the start"
    ) from failure


def open_run(
    run_dir: Path,
    checkpoint: run_files.Checkpoint | None,
    config_record: run_files.JsonObject,
    note: Callable[[str], None],
) -> int:
    """Make ``run_dir`` a run (or continue it) once every check has passed; the start step.

    The rows and rollouts after the checkpoint are dropped (they are redone), a fallback
    checkpoint becomes the run's, summary.json is removed and config.json written.
    """
    start_step = checkpoint.step if checkpoint is not None else 0
    dropped = run_files.prepare_metrics_for_resume(run_dir, checkpoint.step if checkpoint else None)
    run_files.prepare_rollouts_for_resume(run_dir, checkpoint.step if checkpoint else None)
    if checkpoint is not None and checkpoint != run_files.read_checkpoint(run_dir):
        # The fallback becomes the run's checkpoint (a later stop does not look for it again).
        run_name = config_record.get("run_name") or run_dir.name
        run_files.write_checkpoint(run_dir, checkpoint, run_name=str(run_name))
    if dropped:
        note(f"resuming at step {start_step}: {dropped} logged row(s) after it will be redone")
    (run_dir / run_files.SUMMARY_FILE).unlink(missing_ok=True)
    run_files.write_json_atomic(run_dir / run_files.CONFIG_FILE, config_record)
    return start_step


def logged_usage(run_dir: Path, step: int) -> TokenUsage:
    """The cumulative usage of the logged row of ``step`` (a resumed run continues from it)."""
    rows = [row for row in run_files.read_metrics(run_dir) if row[run_files.STEP_KEY] == step]
    return usage_from_row(rows[-1]) if rows else TokenUsage()


def start_state(run_dir: Path, start_step: int) -> RunState:
    """The progress of a run about to take step ``start_step`` + 1."""
    return RunState(
        completed=start_step,
        last_saved_step=start_step,
        version=start_step,
        usage_logged=logged_usage(run_dir, start_step),
    )


# --- the steps -----------------------------------------------------------------------------


def retry(session: Session, call: Callable[[], T], what: str) -> T:
    """``call()`` with the run's retries of transient backend errors (--max-retries)."""
    return call_with_retries(call, what=what, max_retries=session.max_retries, note=session.note)


def run_step(recipe: Recipe, state: RunState, step: int, echo: Callable[[str], None]) -> None:
    """Step ``step`` whole: the recipe's step, then evaluate when due, log, save when due."""
    session, done = recipe.session, step + 1
    metrics: dict[str, float] = {}
    with timed("time/step", metrics):
        metrics.update(recipe.step(state, step))
        if recipe.evaluates_after(done):
            metrics.update(recipe.evaluate(state))
    if done == session.steps or recipe.saves_after(done):
        state.usage += checkpoint_check_usage(state)  # logged with this row
    log_step(recipe, state, done, metrics, echo)
    if recipe.saves_after(done):
        save_checkpoint(recipe, state, f"step-{done:06d}")


def log_step(
    recipe: Recipe,
    state: RunState,
    step: int,
    metrics: dict[str, float],
    echo: Callable[[str], None],
) -> None:
    """A row to disk (durable), then the console; the weights are now ``step``'s."""
    session = recipe.session
    fault_point("log")
    logged = state.usage_logged + state.usage
    metrics.update(usage_metrics(state.usage, logged, session.prices))
    session.logger.log(step, metrics, rollouts=state.rollout_log)
    state.rollout_log = []
    state.usage, state.usage_logged = TokenUsage(), logged
    state.completed, state.weights_dirty, state.last_metrics = step, False, metrics
    echo(recipe.console_line(step, metrics))


def checkpoint_check_usage(state: RunState) -> TokenUsage:
    """The forward-only positions of the check `save_checkpoint` runs: none when no update
    came since the last checked weights (or the run's start or resume).

    Counted into the row of the step it checks, before the call, so a resumed run logs what
    an uninterrupted one does (a checkpoint taken on a stop signal is not counted).
    """
    probe = state.probe_datums or []
    return TokenUsage(forward_tokens=sum(len(datum.model_input) for datum in probe))


def _weights_give_finite_logprobs(session: Session, probe_datums: list[Datum]) -> bool:
    """One forward of ``probe_datums``: are the log-probs finite? (A backend that refuses
    non-finite log-probs itself, as the local one does, answers with a ``non_finite`` error.)"""
    client = session.training_client
    try:
        probe = retry(
            session,
            lambda: client.forward(probe_datums, loss_fn="cross_entropy").result(),
            "forward (checkpoint check)",
        )
    except Exception as error:
        if "non_finite" in str(getattr(error, "code", "")):
            return False
        raise
    return bool(np.isfinite(output_logprobs(probe.loss_fn_outputs)).all())


def save_checkpoint(recipe: Recipe, state: RunState, name: str) -> None:
    """A resumable checkpoint of the weights of step ``state.completed``, if they are sound.

    One forward of the last minibatch first: weights that give non-finite log-probs (a
    diverged update) are never saved as resumable (NonFiniteUpdate instead). What the
    recipe keeps beside the weights (rollouts sampled ahead) is written before the record.
    """
    session = recipe.session
    if state.probe_datums is not None and not _weights_give_finite_logprobs(
        session, state.probe_datums
    ):
        state.weights_dirty = True
        raise NonFiniteUpdate(
            f"the weights after step {state.completed} give non-finite log-probs (a diverged "
            f"update); they are not checkpointed, the last good checkpoint is step "
            f"{state.last_saved_step}; lower --learning-rate"
        )
    state.probe_datums = None  # these weights are checked: until the next update, no check
    client = session.training_client
    result = retry(session, lambda: client.save_state(name).result(), "save_state")
    fault_point("save")
    recipe.save_beside(state, result.path)
    run_files.write_checkpoint(
        session.run_dir,
        run_files.Checkpoint(step=state.completed, state_path=result.path),
        run_name=session.run_name,
    )
    recipe.saved(state)
    state.last_saved_step = state.completed


def run_steps(
    recipe: Recipe, state: RunState, echo: Callable[[str], None], progress: bool
) -> RunResult:
    """Every step not yet logged, the final checkpoint and sampler weights, summary.json."""
    from tqdm import tqdm

    session = recipe.session
    # A bar redraws itself with carriage returns: only on a terminal (disable=None: off when
    # stderr is not a TTY), so a log file (an experiment's train.log) holds whole lines only.
    bar = tqdm(
        total=session.steps,
        initial=state.completed,
        desc=recipe.progress_label,
        unit="step",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    echo_beside_bar = echo if bar.disable else bar.write
    clock: dict[str, float] = {}
    resume = f"`grpo {recipe.command} --resume {session.run_dir}`"
    with timed("wall_time_s", clock):
        try:
            with stop_on_signals() as stop_requested, recipe.calls(stop_requested):
                sampler_path = _steps_then_final_save(
                    recipe, state, stop_requested, bar, echo_beside_bar
                )
        except KeyboardInterrupt:
            _stop_with_checkpoint(recipe, state)
            raise RunStopped(
                f"stopped by signal after step {state.completed}; resume with {resume}",
                exit_code=130,
            ) from None
        except Exception as error:
            _stop_with_checkpoint(recipe, state)
            raise RunStopped(
                f"run failed at step {state.completed + 1}: {type(error).__name__}: {error}\n"
                f"resume with {resume}",
                exit_code=1,
            ) from error
        finally:
            recipe.close(state)
            bar.close()
            session.logger.close()

    wall_time = clock["wall_time_s"]
    run_files.write_json_atomic(
        session.run_dir / run_files.SUMMARY_FILE,
        {
            "finished": True,
            **recipe.summary(state),
            "steps": session.steps,
            "wall_time_s": wall_time,
            "final": state.last_metrics,
            **run_files.summary_sampler_path(session.run_dir, sampler_path),
            "run_name": session.run_name,
            **usage_summary(state.usage_logged + state.usage, session.prices),
        },
    )
    echo(
        f"[grpo] done: {session.steps} {recipe.steps_word} in {wall_time:.1f}s; final sampler "
        f"weights: {sampler_path}"
    )
    return RunResult(
        run_dir=session.run_dir,
        steps=session.steps,
        final_metrics=state.last_metrics,
        sampler_path=sampler_path,
    )


def _steps_then_final_save(
    recipe: Recipe,
    state: RunState,
    stop_requested: threading.Event,
    bar: tqdm[NoReturn],
    echo: Callable[[str], None],
) -> str:
    """The baseline row, every step not yet logged, the final checkpoint and weights."""
    session = recipe.session
    if state.completed == 0 and recipe.evaluates_after(0):
        log_step(recipe, state, 0, recipe.baseline(state), echo)
    for step in range(state.completed, session.steps):
        if stop_requested.is_set():
            raise KeyboardInterrupt
        run_step(recipe, state, step, echo)
        bar.update(1)
    save_checkpoint(recipe, state, "final")
    client = session.training_client
    return retry(
        session,
        lambda: client.save_weights_for_sampler(sampler_weights_name(session.run_name)).result(),
        "save_weights_for_sampler",
    ).path


def usage_summary(usage: TokenUsage, prices: Prices | None) -> run_files.JsonObject:
    """summary.json's ``usage`` (the last row's cumulative usage) and, with prices, ``cost``."""
    summary: run_files.JsonObject = {"usage": attrs.asdict(usage)}
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


def _stop_with_checkpoint(recipe: Recipe, state: RunState) -> None:
    """Save a resumable checkpoint at the last logged step, unless the weights moved past it."""
    note = recipe.session.note
    if state.weights_dirty:
        note(
            f"stopped mid-step: keeping the checkpoint of step {state.last_saved_step} (the "
            "weights of a step whose row was not logged are not resumable)"
        )
        return
    if state.completed == state.last_saved_step:
        return
    try:
        save_checkpoint(recipe, state, f"step-{state.completed:06d}")
        note(f"checkpoint saved at step {state.completed}")
    except Exception as error:  # noqa: BLE001 - the original failure is what the user must see
        note(
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

    def handler(signum: int, _frame: FrameType | None) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def adam_params(config: OptimizerSettings, learning_rate: float) -> AdamParams:
    """PyTRIO's AdamParams at ``learning_rate`` with a run config's --beta1, --beta2, --eps,
    --weight-decay and --grad-clip-norm (every recipe shares these flags)."""
    return AdamParams(
        learning_rate=learning_rate,
        beta1=config.beta1,
        beta2=config.beta2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        grad_clip_norm=config.grad_clip_norm,
    )


def run_divisor(
    config: RunConfig,
    probe: run_files.JsonObject | None,
    note: Callable[[str], None],
    service: ServiceClient | None = None,
) -> ServiceDivisor:
    """What the service divides a loss's gradient by (`service_divisor`: the local backend's
    own, the flag, the probe's verdict, or the documented default), noted on a service; a
    flag the probe contradicts is noted too (the flag wins). Every recipe's: `grpo train`
    passes its probe, the data recipes (`sft`, ...) none."""
    probed = None if probe is None else probe.get("convention")
    reported = getattr(service, "service_normalization", None)
    divisor = service_divisor(
        config.backend,
        config.service_normalization,
        probed,
        reported if isinstance(reported, str) else None,
    )
    if config.backend == "local":
        return divisor
    source = {
        "flag": "--service-normalization",
        "probe": "the normalization probe",
        "default": "not measured: the documented default, docs/FORMULAS.md",
        "tinker": "Tinker's documented convention: built-in losses are sums over tokens",
    }[divisor.source]
    note(
        f"the service divides a loss's gradient by: {divisor.convention} ({source}); each "
        "request's datums are pre-scaled for it, so the gradient applied is the loss's own"
    )
    if divisor.source == "flag" and probed is not None and probed != divisor.convention:
        note(
            f"the normalization probe measured {probed}, but --service-normalization says "
            f"{divisor.convention}; the run follows the flag (drop it to follow the probe)"
        )
    return divisor
