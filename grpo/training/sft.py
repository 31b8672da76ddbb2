"""`grpo sft`: supervised fine-tuning of a LoRA on completion / assistant tokens.

The recipe: the rows of --data (`grpo.tasks.sft_data`) as token sequences with a mask of
the tokens to learn; a held-out split (--eval-data, else --eval-fraction of --data); every
training row once per epoch, in batches of at most --batch-tokens tokens
(`grpo.core.sft.token_batches`); one `forward_backward` with the service's built-in
``cross_entropy`` loss and one `optim_step` per batch, the learning rate warmed up and
decayed by --lr-schedule; the eval loss every --eval-every steps. The loss of a batch is the
mean negative log-prob of its trained tokens (docs/FORMULAS.md, "Supervised fine-tuning"):
each datum's ``weights`` are its mask over the batch's trained-token count, summed by the
service.

The run around it is `grpo train`'s: the run directory and its lock, config.json,
metrics.jsonl, checkpoint.json (every --save-every steps and at the end), summary.json with
the final sampler weights (what `grpo train --init-from` and `grpo distill --teacher`
read), resume with the same batches and learning rates, a checkpoint on Ctrl-C/SIGTERM,
token usage and cost, SwanLab, and a dry run that writes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from pytrio.types import AdamParams, Datum, ModelInput, TensorData

from grpo.backends.datums import output_logprobs
from grpo.backends.pytrio import call_with_retries, make_service_client
from grpo.core.sft import (
    SftExample,
    heldout_split,
    lr_multiplier,
    token_batches,
    token_mean_cross_entropy,
    token_mean_weights,
)
from grpo.core.usage import Prices, TokenUsage, cost, usage_metrics
from grpo.tasks.sft_data import SftDataError, load_examples
from grpo.training import run_files
from grpo.training.config import FIELDS as TRAIN_FIELDS
from grpo.training.fields import ConfigError
from grpo.training.logging import RunLogger, scrub_secrets
from grpo.training.prices import prices_for
from grpo.training.rollouts import tokenizer_max_len
from grpo.training.run import (
    RunResult,
    RunStopped,
    check_run_status,
    logged_usage,
    sampler_weights_name,
    stop_on_signals,
    usage_summary,
)
from grpo.training.sft_config import SftConfig, resolve_sft_run, sft_to_dict
from grpo.training.timing import timed

__all__ = ["SftPlan", "dry_run_sft", "example_datum", "sft"]


@attrs.frozen
class SftPlan:
    """What the pre-flight built: the encoded rows, every step's batch, the service."""

    config: SftConfig
    service: Any
    tokenizer: Any
    train: list[SftExample]
    eval: list[SftExample]
    batches: list[np.ndarray]
    """Row indices into ``train`` of every step, epochs end to end."""
    epochs_of_steps: list[int]
    prices: Prices | None

    @property
    def steps(self) -> int:
        """Optimizer steps of the whole run."""
        return len(self.batches)


def example_datum(example: SftExample, weights_T: np.ndarray) -> Datum:
    """tokens[:-1] predicting tokens[1:], each target weighted by ``weights_T[1:]``."""
    tokens = example.tokens_T
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(tokens[1:]),
            "weights": TensorData.from_numpy(np.asarray(weights_T[1:], dtype=np.float32)),
        },
    )


def batch_datums(examples: list[SftExample]) -> list[Datum]:
    """The batch's datums, weights = mask / the batch's trained tokens (a token mean)."""
    weights_B = token_mean_weights([example.mask_T for example in examples])
    return [example_datum(example, weights) for example, weights in zip(examples, weights_B)]


def _make_service(config: SftConfig, run_dir: Path) -> Any:
    return make_service_client(
        config.backend,
        local_root=str(run_dir / run_files.BACKEND_DIR),
        seed=config.seed,
        connect_timeout_s=config.connect_timeout,
        concurrency=TRAIN_FIELDS["concurrency"].default,
    )


def _encoded(tokenizer: Any, path: str, max_len: int | None) -> list[SftExample]:
    try:
        examples = load_examples(tokenizer, path)
    except SftDataError as error:
        raise ConfigError(str(error)) from None
    if max_len is not None:
        for number, example in enumerate(examples, start=1):
            if example.tokens_T.size > max_len:
                raise ConfigError(
                    f"{path} row {number} has {example.tokens_T.size} tokens, more than the "
                    f"model's context of {max_len}; shorten it"
                )
    return examples


def preflight_sft(config: SftConfig, make_service: Callable[[], Any]) -> SftPlan:
    """Prices, the data (read, encoded, split, batched), all before the first training call."""
    prices = prices_for(config)  # type: ignore[arg-type]  # reads base_model and price_*
    for path in (config.data, config.eval_data):
        if path is not None and not Path(path).exists():
            raise ConfigError(f"data file {path} not found; check --data / --eval-data")
    service = make_service()
    tokenizer = service.create_sampling_client(base_model=config.base_model).get_tokenizer()
    max_len = tokenizer_max_len(tokenizer)
    rows = _encoded(tokenizer, str(config.data), max_len)
    if config.eval_data is not None:
        train, held = rows, _encoded(tokenizer, config.eval_data, max_len)
    else:
        try:
            train_rows, eval_rows = heldout_split(len(rows), config.eval_fraction, config.seed)
        except ValueError as error:
            raise ConfigError(f"--eval-fraction: {error}") from None
        train, held = [rows[i] for i in train_rows], [rows[i] for i in eval_rows]
    lengths = [example.tokens_T.size for example in train]
    batches, epochs = [], []
    for epoch in range(config.epochs):
        try:
            parts = token_batches(
                lengths, budget=config.batch_tokens, seed=config.seed, epoch=epoch
            )
        except ValueError as error:
            raise ConfigError(f"--batch-tokens {config.batch_tokens}: {error}") from None
        batches += parts
        epochs += [epoch] * len(parts)
    return SftPlan(config, service, tokenizer, train, held, batches, epochs, prices)


def evaluates(config: SftConfig, done: int, steps: int, has_eval: bool) -> bool:
    """Whether the eval loss is measured after ``done`` steps (0: before training)."""
    if not has_eval or config.eval_every == 0:
        return False
    return done % config.eval_every == 0 or done == steps


def saves(config: SftConfig, done: int, steps: int) -> bool:
    """Whether a checkpoint follows step ``done`` (every --save-every, and the last)."""
    return done == steps or (config.save_every > 0 and done % config.save_every == 0)


def planned_usage(plan: SftPlan, start_step: int = 0) -> TokenUsage:
    """The run's exact trained positions and eval forward positions from ``start_step``."""
    positions = [example.num_positions for example in plan.train]
    trained = sum(positions[i] for batch in plan.batches[start_step:] for i in batch)
    evals = sum(
        evaluates(plan.config, done, plan.steps, bool(plan.eval))
        for done in range(start_step, plan.steps + 1)
        if done > start_step or done == 0
    )
    per_eval = sum(example.num_positions for example in plan.eval)
    return TokenUsage(trained_tokens=trained, forward_tokens=evals * per_eval)


def dry_run_sft(
    config: SftConfig, *, resume: bool = False, service_client: Any = None
) -> list[str]:
    """`grpo sft --dry-run`: every check of a run, then its plan; nothing is written."""
    config = resolve_sft_run(config)
    run_dir = Path(str(config.run_dir))
    checkpoint = check_run_dir(run_dir, resume)
    if checkpoint is False:
        return [f"{run_dir} already finished; nothing to plan"]
    start = checkpoint.step if checkpoint is not None else 0
    plan = preflight_sft(config, lambda: service_client or _make_service(config, run_dir))
    usage = planned_usage(plan, start)
    sizes = [batch.size for batch in plan.batches]
    lines = [
        f"dry run of {run_dir}: every check passed; no training run was created",
        f"  backend {config.backend}, model {config.base_model}",
        f"  data: {len(plan.train)} train / {len(plan.eval)} held-out rows "
        f"({sum(e.num_trained for e in plan.train):,} trained tokens a pass)",
        f"  plan: steps {start}..{plan.steps} ({config.epochs} epoch(s), batches of "
        f"{min(sizes)}..{max(sizes)} rows <= {config.batch_tokens} tokens), lr "
        f"{config.learning_rate:g} {config.lr_schedule} after {config.warmup_steps} warm-up",
        f"  trained tokens (positions) {usage.trained_tokens:>12,}  exact",
        f"  forward-only tokens (eval) {usage.forward_tokens:>12,}  exact",
    ]
    if plan.prices is None:
        lines.append("  cost: no prices given (--price-file or --price-* flags)")
    else:
        lines.append(f"  cost {cost(usage, plan.prices):.4f} {plan.prices.currency}")
    if service_client is None and hasattr(plan.service, "close"):
        plan.service.close()
    return lines


def check_run_dir(run_dir: Path, resume: bool) -> run_files.Checkpoint | None | bool:
    """The checkpoint to resume (None: a fresh run), or False when the run already finished."""
    status = check_run_status(run_dir, resume, "sft")
    if status is None:
        return None
    if status == run_files.FINISHED:
        return False
    return run_files.read_checkpoint(run_dir)


def sft(
    config: SftConfig,
    *,
    resume: bool = False,
    service_client: Any = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> RunResult:
    """Supervised fine-tuning for --epochs passes over --data (or continue it with resume)."""
    config = resolve_sft_run(config)
    run_dir = Path(str(config.run_dir))
    with run_files.owned(run_dir):
        checkpoint = check_run_dir(run_dir, resume)
        if checkpoint is False:
            summary = run_files.read_summary(run_dir) or {}
            echo(f"[grpo] {run_dir} already finished; nothing to do")
            return RunResult(
                run_dir=run_dir,
                steps=int(summary.get("steps", 0)),
                final_metrics=dict(summary.get("final", {})),
                sampler_path=summary.get("sampler_path"),
            )
        plan = preflight_sft(config, lambda: service_client or _make_service(config, run_dir))
        return SftRun(plan, run_dir, checkpoint, echo).run(progress)


class SftRun:
    """One SFT run's clients, sinks and progress (the step loop)."""

    def __init__(
        self,
        plan: SftPlan,
        run_dir: Path,
        checkpoint: run_files.Checkpoint | None,
        echo: Callable[[str], None],
    ) -> None:
        config = self.config = plan.config
        self.plan, self.run_dir, self.echo = plan, run_dir, echo
        service = plan.service
        if checkpoint is not None:
            self.client = service.create_training_client_from_state_with_optimizer(
                checkpoint.state_path
            )
        else:
            self.client = service.create_lora_training_client(
                base_model=config.base_model, rank=config.lora_rank, seed=config.seed
            )
        start = checkpoint.step if checkpoint is not None else 0
        dropped = run_files.prepare_metrics_for_resume(
            run_dir, checkpoint.step if checkpoint else None
        )
        if dropped:
            echo(
                f"[grpo] resuming at step {start}: {dropped} logged row(s) after it will be redone"
            )
        run_files.write_json_atomic(
            run_dir / run_files.CONFIG_FILE, scrub_secrets(sft_to_dict(config))
        )
        self.logger = RunLogger(
            run_dir,
            config=sft_to_dict(config),
            swanlab_mode=config.swanlab_mode,
            swanlab_project=config.swanlab_project,
            run_name=str(config.run_name),
        )
        self.completed = self.saved = start
        self.usage, self.usage_logged = TokenUsage(), logged_usage(run_dir, start)
        self.last_metrics: dict[str, float] = {}
        self.dirty = False

    def _retry(self, call: Callable[[], Any], what: str) -> Any:
        return call_with_retries(
            call,
            what=what,
            max_retries=self.config.max_retries,
            on_retry=lambda m: self.echo(f"[grpo] {m}"),
        )

    def eval_loss(self) -> dict[str, float]:
        """eval/loss: the token-mean cross-entropy over every held-out row (forward only)."""
        logprobs, masks = [], []
        for batch in token_batches(
            [e.tokens_T.size for e in self.plan.eval],
            budget=self.config.batch_tokens,
            seed=0,
            epoch=0,
        ):
            examples = [self.plan.eval[i] for i in batch]
            datums = batch_datums(examples)
            result = self._retry(
                lambda datums=datums: self.client.forward(datums, loss_fn="cross_entropy").result(),
                "forward (eval loss)",
            )
            logprobs.append(output_logprobs(result.loss_fn_outputs))
            masks += [example.mask_T[1:] for example in examples]
            self.usage += TokenUsage(forward_tokens=sum(e.num_positions for e in examples))
        return {
            "eval/loss": token_mean_cross_entropy(np.concatenate(logprobs), np.concatenate(masks))
        }

    def train_step(self, step: int) -> dict[str, float]:
        """One batch: forward_backward (cross_entropy), then optim_step at the step's rate."""
        config, plan = self.config, self.plan
        examples = [plan.train[i] for i in plan.batches[step]]
        datums = batch_datums(examples)
        result = self._retry(
            lambda: self.client.forward_backward(datums, loss_fn="cross_entropy").result(),
            "forward_backward",
        )
        rate = config.learning_rate * lr_multiplier(
            step,
            total_steps=plan.steps,
            warmup_steps=config.warmup_steps,
            schedule=config.lr_schedule,
        )
        adam = AdamParams(
            learning_rate=rate,
            beta1=config.beta1,
            beta2=config.beta2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            grad_clip_norm=config.grad_clip_norm,
        )
        self.dirty = True  # the weights move past the logged step until this row is logged
        optim = self._retry(lambda: self.client.optim_step(adam).result(), "optim_step")
        positions = sum(example.num_positions for example in examples)
        self.usage += TokenUsage(trained_tokens=positions)
        masks = np.concatenate([example.mask_T[1:] for example in examples])
        return {
            "loss": token_mean_cross_entropy(output_logprobs(result.loss_fn_outputs), masks),
            "learning_rate": rate,
            "epoch": float(plan.epochs_of_steps[step]),
            "rows": float(len(examples)),
            "train_tokens": float(masks.sum()),
            "positions": float(positions),
            "grad_norm": float(optim.metrics.get("grad_norm", float("nan"))),
        }

    def log(self, step: int, metrics: dict[str, float], write: Callable[[str], None]) -> None:
        """The step's row to disk (durable) with its usage, then the console line."""
        logged = self.usage_logged + self.usage
        metrics.update(usage_metrics(self.usage, logged, self.plan.prices))
        self.logger.log(step, metrics)
        self.usage, self.usage_logged = TokenUsage(), logged
        self.completed, self.last_metrics, self.dirty = step, metrics, False
        parts = [f"step {step}/{self.plan.steps}"]
        for key, fmt in (("loss", "{:.4f}"), ("eval/loss", "{:.4f}"), ("learning_rate", "{:.2e}")):
            if key in metrics:
                parts.append(f"{key}={fmt.format(metrics[key])}")
        if "cost/cum" in metrics:
            parts.append(f"cost={metrics['cost/cum']:.4f}")
        write(" | ".join(parts))

    def save(self, name: str) -> None:
        """A resumable checkpoint of the weights of step ``self.completed``."""
        result = self._retry(lambda: self.client.save_state(name).result(), "save_state")
        run_files.write_checkpoint(
            self.run_dir,
            run_files.Checkpoint(step=self.completed, state_path=result.path),
            run_name=str(self.config.run_name),
        )
        self.saved = self.completed

    def _steps(self, stop: threading.Event, bar: Any, write: Callable[[str], None]) -> str:
        steps, has_eval = self.plan.steps, bool(self.plan.eval)
        if self.completed == 0 and evaluates(self.config, 0, steps, has_eval):
            self.log(0, self.eval_loss(), write)
        for step in range(self.completed, steps):
            if stop.is_set():
                raise KeyboardInterrupt
            metrics: dict[str, float] = {}
            with timed("time/step", metrics):
                metrics.update(self.train_step(step))
                if evaluates(self.config, step + 1, steps, has_eval):
                    metrics.update(self.eval_loss())
            self.log(step + 1, metrics, write)
            bar.update(1)
            if saves(self.config, step + 1, steps) and step + 1 < steps:
                self.save(f"step-{step + 1:06d}")
        self.save("final")
        name = sampler_weights_name(str(self.config.run_name))
        return self._retry(
            lambda: self.client.save_weights_for_sampler(name).result(), "save_weights_for_sampler"
        ).path

    def _stop(self) -> None:
        """A checkpoint of the last logged step, unless the weights already moved past it."""
        if self.dirty:
            self.echo(f"[grpo] stopped mid-step: keeping the checkpoint of step {self.saved}")
        elif self.completed != self.saved:
            try:
                self.save(f"step-{self.completed:06d}")
                self.echo(f"[grpo] checkpoint saved at step {self.completed}")
            except Exception as error:  # noqa: BLE001 - the original stop is what matters
                self.echo(f"[grpo] could not save a checkpoint ({error}); last is {self.saved}")

    def run(self, progress: bool) -> RunResult:
        """Every step not yet logged, the final checkpoint and sampler weights, summary.json."""
        from tqdm import tqdm

        bar = tqdm(
            total=self.plan.steps,
            initial=self.completed,
            desc="sft",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        write = bar.write if progress else self.echo
        clock: dict[str, float] = {}
        resume = f"`grpo sft --resume {self.run_dir}`"
        with timed("wall_time_s", clock):
            try:
                with stop_on_signals() as stop:
                    sampler_path = self._steps(stop, bar, write)
            except KeyboardInterrupt:
                self._stop()
                raise RunStopped(
                    f"stopped by signal after step {self.completed}; resume with {resume}", 130
                ) from None
            except Exception as error:
                self._stop()
                raise RunStopped(
                    f"run failed at step {self.completed + 1}: {type(error).__name__}: {error}\n"
                    f"resume with {resume}",
                    exit_code=1,
                ) from error
            finally:
                bar.close()
                self.logger.close()
        run_files.write_json_atomic(
            self.run_dir / run_files.SUMMARY_FILE,
            {
                "finished": True,
                "recipe": "sft",
                "steps": self.plan.steps,
                "wall_time_s": clock["wall_time_s"],
                "final": self.last_metrics,
                "eval/loss": self.last_metrics.get("eval/loss"),
                **run_files.summary_sampler_path(self.run_dir, sampler_path),
                "run_name": self.config.run_name,
                **usage_summary(self.usage_logged + self.usage, self.plan.prices),
            },
        )
        self.echo(
            f"[grpo] done: {self.plan.steps} SFT steps in {clock['wall_time_s']:.1f}s; final "
            f"sampler weights: {sampler_path}"
        )
        return RunResult(self.run_dir, self.plan.steps, self.last_metrics, sampler_path)
