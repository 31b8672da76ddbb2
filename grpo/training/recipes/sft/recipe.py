"""`grpo sft`: supervised fine-tuning of a LoRA on completion / assistant tokens.

The recipe: the rows of --data (`grpo.training.recipes.sft.data`) as token sequences with a mask of
the tokens to learn; a held-out split (--eval-data, else --eval-fraction of --data); every
training row once per epoch, in batches of at most --batch-tokens tokens
(`grpo.core.sft.token_batches`); one `forward_backward` with the service's built-in
``cross_entropy`` loss and one `optim_step` per batch, the learning rate warmed up and
decayed by --lr-schedule; the eval loss every --eval-every steps. The loss of a batch is the
mean negative log-prob of its trained tokens (docs/FORMULAS.md, "Supervised fine-tuning"):
each datum's ``weights`` are its mask over the batch's trained-token count, summed by the
service.

The run around it is the lifecycle every recipe shares (`grpo.training.run.lifecycle`): the run
directory and its lock, config.json, metrics.jsonl, checkpoint.json (every --save-every
steps and at the end, never of weights whose log-probs are not finite), resume with the
same batches and learning rates (from the newest intact checkpoint when the latest cannot
be loaded), a checkpoint on Ctrl-C/SIGTERM, summary.json with the final sampler weights
(what `grpo train --init-from` and `grpo distill --teacher` read), token usage and cost,
SwanLab; and a dry run that writes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, Unpack

import attrs
import numpy as np
from pytrio.types import Datum, ModelInput, OptimStepResponse, TensorData

from grpo.backends.clients import ServiceClient
from grpo.backends.datums import datum_totals, forward_only, output_logprobs, scale_weights
from grpo.core.sft import (
    SftExample,
    heldout_split,
    lr_multiplier,
    token_batches,
    token_mean_cross_entropy,
    token_mean_weights,
)
from grpo.core.usage import Prices, TokenUsage, cost
from grpo.training.recipes.sft.config import SftConfig, resolve_sft_run, sft_to_dict
from grpo.training.recipes.sft.data import SftDataError, load_examples
from grpo.training.rollouts.clients import Tokenizer
from grpo.training.rollouts.problems import tokenizer_max_len
from grpo.training.run import run_files
from grpo.training.run.inputs import checked_run_dir
from grpo.training.run.lifecycle import (
    RunResult,
    adam_params,
    check_run_status,
    close_opened,
    finished_result,
    open_run,
    open_training_client,
    retry,
    run_divisor,
    run_service,
    run_steps,
    start_state,
)
from grpo.training.run.recipe import DryRunOptions, RunOptions, Session
from grpo.training.run.run_log import RunLogger, scrub_secrets
from grpo.training.run.state import RunState
from grpo.training.settings.config_groups import RunSettings
from grpo.training.settings.fields import ConfigError
from grpo.training.settings.prices import prices_for

if TYPE_CHECKING:
    from grpo.training.recipes.dpo.config import DpoConfig

__all__ = ["SftPlan", "dry_run_sft", "example_datum", "sft"]

DataRecipeConfig: TypeAlias = "SftConfig | DpoConfig"
"""The config of a data recipe (SFT, DPO): the flags the shared helpers below read."""


@attrs.frozen
class SftPlan:
    """What the pre-flight built: the encoded rows, every step's batch, the service."""

    config: SftConfig
    service: ServiceClient
    tokenizer: Tokenizer
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

    @property
    def init_state(self) -> None:
        """SFT has no --init-from: it starts from its checkpoint, else a fresh LoRA."""
        return None

    def describe(self, start: int) -> tuple[list[str], TokenUsage]:
        """Its dry-run lines from step ``start``, and its usage from there."""
        config = self.config
        usage = planned_usage(self, start)
        sizes = [batch.size for batch in self.batches]
        lines = [
            f"dry run of {config.run_dir}: every check passed; no training run was created",
            f"  backend {config.backend}, model {config.base_model}",
            f"  data: {len(self.train)} train / {len(self.eval)} held-out rows "
            f"({sum(e.num_trained for e in self.train):,} trained tokens a pass)",
            f"  plan: steps {start}..{self.steps} ({config.epochs} epoch(s), batches of "
            f"{min(sizes)}..{max(sizes)} rows <= {config.batch_tokens} tokens), lr "
            f"{config.learning_rate:g} {config.lr_schedule} after {config.warmup_steps} warm-up",
            f"  trained tokens (positions) {usage.trained_tokens:>12,}  exact",
            f"  forward-only tokens (eval) {usage.forward_tokens:>12,}  exact",
        ]
        return lines, usage


class DataPlan(Protocol):
    """What the shared data-recipe code (`run_data_recipe`, ...) reads of a pre-flight's plan
    (`SftPlan`, `DpoPlan`)."""

    @property
    def config(self) -> DataRecipeConfig: ...

    @property
    def service(self) -> ServiceClient: ...

    @property
    def eval(self) -> Sequence[object]: ...

    @property
    def prices(self) -> Prices | None: ...

    @property
    def steps(self) -> int: ...

    @property
    def init_state(self) -> str | None: ...

    def describe(self, start: int) -> tuple[list[str], TokenUsage]:
        """Its dry-run lines from step ``start`` (its cost aside), and its usage from there."""
        ...


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


def _encoded(tokenizer: Tokenizer, path: str, max_len: int | None) -> list[SftExample]:
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


def check_data_files(config: DataRecipeConfig) -> None:
    """ConfigError unless --data and --eval-data (when given) exist."""
    for path in (config.data, config.eval_data):
        if path is not None and not Path(path).exists():
            raise ConfigError(f"data file {path} not found; check --data / --eval-data")


Item = TypeVar("Item")


def encoded_split(
    config: DataRecipeConfig,
    tokenizer: Tokenizer,
    encode: Callable[[Tokenizer, str, int | None], list[Item]],
) -> tuple[list[Item], list[Item]]:
    """(train, held-out) items of a data recipe, each file encoded by ``encode(tokenizer,
    path, max_len)``: --eval-data when given, else --eval-fraction of --data (by --seed)."""
    max_len = tokenizer_max_len(tokenizer)
    items = encode(tokenizer, str(config.data), max_len)
    if config.eval_data is not None:
        return items, encode(tokenizer, config.eval_data, max_len)
    try:
        train_rows, eval_rows = heldout_split(len(items), config.eval_fraction, config.seed)
    except ValueError as error:
        raise ConfigError(f"--eval-fraction: {error}") from None
    return [items[i] for i in train_rows], [items[i] for i in eval_rows]


def preflight_sft(config: SftConfig, make_service: Callable[[], ServiceClient]) -> SftPlan:
    """Prices, the data (read, encoded, split, batched), all before the first training call."""
    prices = prices_for(config)  # type: ignore[arg-type]  # reads base_model and price_*
    check_data_files(config)
    service = make_service()
    tokenizer = service.create_sampling_client(base_model=config.base_model).get_tokenizer()
    train, held = encoded_split(config, tokenizer, _encoded)
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


def evaluates(config: DataRecipeConfig, done: int, steps: int, has_eval: bool) -> bool:
    """Whether the eval loss is measured after ``done`` steps (0: before training)."""
    if not has_eval or config.eval_every == 0:
        return False
    return done % config.eval_every == 0 or done == steps


def saves(config: DataRecipeConfig, done: int, steps: int) -> bool:
    """Whether a checkpoint follows step ``done`` (every --save-every, and the last)."""
    return done == steps or (config.save_every > 0 and done % config.save_every == 0)


def evaluations(config: DataRecipeConfig, start_step: int, steps: int, has_eval: bool) -> int:
    """How many evaluations a run makes from ``start_step`` (the one before training only
    when it starts at step 0: a resume has logged it)."""
    return sum(
        evaluates(config, done, steps, has_eval)
        for done in range(start_step, steps + 1)
        if done > start_step or done == 0
    )


def planned_usage(plan: SftPlan, start_step: int = 0) -> TokenUsage:
    """The run's exact trained positions and eval forward positions from ``start_step``."""
    positions = [example.num_positions for example in plan.train]
    trained = sum(positions[i] for batch in plan.batches[start_step:] for i in batch)
    evals = evaluations(plan.config, start_step, plan.steps, bool(plan.eval))
    per_eval = sum(example.num_positions for example in plan.eval)
    return TokenUsage(trained_tokens=trained, forward_tokens=evals * per_eval)


def dry_run_sft(config: SftConfig, **options: Unpack[DryRunOptions]) -> list[str]:
    """`grpo sft --dry-run`: every check of a run, then its plan; nothing is written."""
    return dry_run_data_recipe(resolve_sft_run(config), "sft", preflight_sft, **options)


def dry_run_data_recipe(
    config: Config,
    command: str,
    preflight: Callable[[Config, Callable[[], Any]], DataPlan],
    *,
    resume: bool = False,
    service_client: ServiceClient | None = None,
) -> list[str]:
    """A data recipe's dry run (SFT, DPO): every check of a run (`preflight`'s plan), then
    the plan's lines from its first step (``describe``), with its cost; nothing is written."""
    run_dir = checked_run_dir(config)
    checkpoint = check_run_dir(run_dir, resume, command)
    if checkpoint is False:
        return [f"{run_dir} already finished; nothing to plan"]
    start = checkpoint.step if checkpoint is not None else 0
    plan = preflight(config, lambda: service_client or run_service(config, run_dir))
    lines, usage = plan.describe(start)
    return finish_dry_run(lines, usage, plan, service_client)


def finish_dry_run(
    lines: list[str], usage: TokenUsage, plan: DataPlan, service_client: ServiceClient | None
) -> list[str]:
    """A data recipe's dry-run lines with the plan's cost added (or why there is none); the
    service closed unless the caller passed it in."""
    if plan.prices is None:
        lines.append("  cost: no prices given (--price-file or --price-* flags)")
    else:
        lines.append(f"  cost {cost(usage, plan.prices):.4f} {plan.prices.currency}")
    close_opened(plan.service, service_client)
    return lines


def check_run_dir(
    run_dir: Path, resume: bool, command: str = "sft"
) -> run_files.Checkpoint | None | bool:
    """The checkpoint to resume (None: a fresh run), or False when the run already finished."""
    status = check_run_status(run_dir, resume, command)
    if status is None:
        return None
    if status == run_files.FINISHED:
        return False
    return run_files.read_checkpoint(run_dir)


def sft(config: SftConfig, **options: Unpack[RunOptions]) -> RunResult:
    """Supervised fine-tuning for --epochs passes over --data (or continue it with resume)."""
    config = resolve_sft_run(config)
    return run_data_recipe(
        config,
        "sft",
        sft_to_dict(config),
        preflight_sft,
        lambda plan, session: (SftRecipe(plan, session), TokenUsage()),
        **options,
    )


Plan = TypeVar("Plan", bound=DataPlan)
Config = TypeVar("Config", bound=RunSettings)


def run_data_recipe(
    config: Config,
    command: str,
    saved_config: dict[str, Any],
    preflight: Callable[[Config, Callable[[], Any]], Plan],
    begin: Callable[[Plan, Session], tuple[DataRecipe, TokenUsage]],
    *,
    resume: bool = False,
    service_client: ServiceClient | None = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> RunResult:
    """A data recipe's run (SFT, DPO; ``run(config, **options)``, `RunOptions`), its run
    directory locked throughout: a finished run's
    result as it stands, else `preflight`'s plan, the session opened (from the checkpoint,
    else the plan's ``init_state``, else a fresh LoRA; ``saved_config`` its config.json), and
    `begin`'s recipe driven over every step not yet logged, the tokens that `begin` sent
    counted in the run's usage."""
    run_dir = checked_run_dir(config)
    with run_files.owned(run_dir):
        checkpoint = check_run_dir(run_dir, resume, command)
        if checkpoint is False:
            return finished_result(run_dir, echo, "")
        plan = preflight(config, lambda: service_client or run_service(config, run_dir))

        session, start = open_recipe_session(
            config,
            plan.service,
            run_dir,
            checkpoint,
            saved_config,
            plan.steps,
            plan.prices,
            echo,
            init_state=plan.init_state,
        )
        recipe, sent = begin(plan, session)
        state = start_state(run_dir, start)
        state.usage += sent
        result = run_steps(recipe, state, echo, progress)
        close_opened(plan.service, service_client)
        return result


def open_recipe_session(
    config: DataRecipeConfig,
    service: ServiceClient,
    run_dir: Path,
    checkpoint: run_files.Checkpoint | None,
    saved_config: run_files.JsonObject,
    steps: int,
    prices: Prices | None,
    echo: Callable[[str], None],
    init_state: str | None = None,
) -> tuple[Session, int]:
    """A data recipe's (SFT, ...) training client, from the checkpoint (with the fallback to
    the newest intact one), else the ``init_state`` weights, else a fresh LoRA; the run
    opened with ``saved_config`` (secrets scrubbed); its Session and first step."""

    def note(message: str) -> None:
        echo(f"[grpo] {message}")

    client, checkpoint = open_training_client(
        service, config, run_dir, checkpoint, init_state, note
    )
    start = open_run(run_dir, checkpoint, scrub_secrets(saved_config), note)
    session = Session(
        run_dir=run_dir,
        run_name=str(config.run_name or run_dir.name),
        steps=steps,
        training_client=client,
        logger=RunLogger.of_run(run_dir, saved_config, config, start_step=start, note=note),
        note=note,
        prices=prices,
        max_retries=config.max_retries,
    )
    return session, start


class DataRecipe:
    """What the data recipes (SFT, ...) share as the lifecycle drives them: planned batches
    of a data file, the learning rate warmed up and decayed by --lr-schedule, the held-out
    evaluation before training, every --eval-every steps and at the end, a checkpoint every
    --save-every steps with nothing beside the weights, no reward workers, nothing in flight.
    A subclass gives ``step``, ``evaluate``, ``console_line`` and ``summary``."""

    def __init__(self, plan: DataPlan, session: Session) -> None:
        self.plan, self.config, self.session = plan, plan.config, session
        self.divisor = run_divisor(self.config, None, session.note, plan.service).convention

    def optim_step(self, step: int) -> tuple[float, OptimStepResponse]:
        """optim_step at step ``step``'s scheduled learning rate: (the rate, the call's result)."""
        config, client = self.config, self.session.training_client
        rate = config.learning_rate * lr_multiplier(
            step,
            total_steps=self.plan.steps,
            warmup_steps=config.warmup_steps,
            schedule=config.lr_schedule,
        )
        adam = adam_params(config, rate)
        return rate, retry(self.session, lambda: client.optim_step(adam).result(), "optim_step")

    def evaluate(self, state: RunState) -> dict[str, float]:
        """The held-out metrics of the current weights (the subclass's)."""
        raise NotImplementedError

    def evaluates_after(self, done: int) -> bool:
        """Before training, every --eval-every steps and at the end, when data is held out."""
        return evaluates(self.config, done, self.plan.steps, bool(self.plan.eval))

    def baseline(self, state: RunState) -> dict[str, float]:
        """The held-out metrics before training."""
        return self.evaluate(state)

    def saves_after(self, done: int) -> bool:
        """Every --save-every steps before the last."""
        return saves(self.config, done, self.plan.steps) and done < self.plan.steps

    def save_beside(self, state: RunState, state_path: str) -> None:
        """Nothing goes with a checkpoint but the weights (a recipe's reference log-probs
        are cached once, before the first step)."""

    def saved(self, state: RunState) -> None:
        """Nothing to prune."""

    def calls(self, stop: threading.Event) -> contextlib.AbstractContextManager[object]:
        """No reward workers."""
        return contextlib.nullcontext()

    def close(self, state: RunState) -> None:
        """Nothing in flight."""


class SftRecipe(DataRecipe):
    """Supervised fine-tuning as the lifecycle drives it: one batch of rows a step."""

    command = "sft"
    progress_label = "sft"
    steps_word = "SFT steps"
    plan: SftPlan

    def step(self, state: RunState, step: int) -> dict[str, float]:
        """One batch: forward_backward (cross_entropy), then optim_step at the step's rate."""
        plan, client = self.plan, self.session.training_client
        examples = [plan.train[i] for i in plan.batches[step]]
        datums = batch_datums(examples)  # 1. the step's rows, weighted for a token mean
        # pre-scaled by the service's divisor D, so the gradient applied is the token mean's
        divisor = datum_totals(datums, loss_fn="cross_entropy").denominator(self.divisor)
        sent = scale_weights(datums, divisor, "weights")
        result = retry(  # 2. forward_backward with the built-in cross-entropy
            self.session,
            lambda: client.forward_backward(sent, loss_fn="cross_entropy").result(),
            "forward_backward",
        )
        state.weights_dirty = True  # the weights move past the logged step until it is logged
        rate, optim = self.optim_step(step)  # 3. optim_step at the step's learning rate
        state.probe_datums = forward_only(datums)  # a checkpoint checks these are finite
        positions = sum(example.num_positions for example in examples)
        state.usage += TokenUsage(trained_tokens=positions)
        masks = np.concatenate([example.mask_T[1:] for example in examples])
        return {  # 4. the step's metrics
            "loss": token_mean_cross_entropy(output_logprobs(result.loss_fn_outputs), masks),
            "learning_rate": rate,
            "epoch": float(plan.epochs_of_steps[step]),
            "rows": float(len(examples)),
            "train_tokens": float(masks.sum()),
            "positions": float(positions),
            "grad_norm": float(optim.metrics.get("grad_norm", float("nan"))),
        }

    def evaluate(self, state: RunState) -> dict[str, float]:
        """eval/loss: the token-mean cross-entropy over every held-out row (forward only)."""
        client = self.session.training_client
        logprobs, masks = [], []
        for batch in token_batches(
            [e.tokens_T.size for e in self.plan.eval],
            budget=self.config.batch_tokens,
            seed=0,
            epoch=0,
        ):
            examples = [self.plan.eval[i] for i in batch]
            datums = batch_datums(examples)
            result = retry(
                self.session,
                lambda datums=datums: client.forward(datums, loss_fn="cross_entropy").result(),
                "forward (eval loss)",
            )
            logprobs.append(output_logprobs(result.loss_fn_outputs))
            masks += [example.mask_T[1:] for example in examples]
            state.usage += TokenUsage(forward_tokens=sum(e.num_positions for e in examples))
        return {
            "eval/loss": token_mean_cross_entropy(np.concatenate(logprobs), np.concatenate(masks))
        }

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """Step, loss, eval loss, learning rate and cost."""
        parts = [f"step {step}/{self.plan.steps}"]
        for key, fmt in (("loss", "{:.4f}"), ("eval/loss", "{:.4f}"), ("learning_rate", "{:.2e}")):
            if key in metrics:
                parts.append(f"{key}={fmt.format(metrics[key])}")
        if "cost/cum" in metrics:
            parts.append(f"cost={metrics['cost/cum']:.4f}")
        return " | ".join(parts)

    def summary(self, state: RunState) -> run_files.JsonObject:
        """The recipe and its final eval loss."""
        return {"recipe": "sft", "eval/loss": state.last_metrics.get("eval/loss")}
