"""`grpo dpo`: preference optimization (DPO, IPO, hinge; RPO's SFT term) of a LoRA on pairs.

The recipe: the pairs of --data (`grpo.training.recipes.dpo.data`: prompt, chosen, rejected,
encoded as `grpo sft` encodes a prompt/completion row), a held-out split (--eval-data, else
--eval-fraction of --data); the reference's sequence log-probs of every completion, computed
once (one ``compute_logprobs`` per sequence) and cached in the run directory
(`grpo.training.recipes.dpo.reference_cache`); every step, --batch-size pairs as two datums
each in one ``forward_backward_custom`` whose loss is the core kernel (`DpoLoss` in
`grpo.training.recipes.dpo.loss`, `grpo.core.dpo`; docs/FORMULAS.md, "Preference
optimization"), then one
``optim_step`` at the step's learning rate (SFT's schedule); ``dpo/*`` from the log-probs the
call returned, ``eval/dpo/*`` from a forward of the held-out pairs every --eval-every steps.

The run around it is the lifecycle every recipe shares (`grpo.training.run.lifecycle`), as
`grpo sft`'s: run directory and lock, resume, Ctrl-C, checkpoints, usage and cost, SwanLab,
summary.json (what `grpo train --init-from` reads), and a dry run that writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Unpack

import attrs
import numpy as np
import torch
from pytrio.types import Datum, ModelInput, TensorData

from grpo.backends.clients import Sampler, ServiceClient
from grpo.backends.datums import output_logprobs
from grpo.core.dpo import PreferencePair, pair_batches, steps_of_one_pass
from grpo.core.sft import SftExample
from grpo.core.usage import Prices, TokenUsage
from grpo.training.recipes.distill.teacher import is_run_dir, weights_sampler
from grpo.training.recipes.dpo.config import DpoConfig, dpo_to_dict, resolve_dpo_run
from grpo.training.recipes.dpo.data import load_pairs
from grpo.training.recipes.dpo.loss import DpoLoss, as_dpo_loss
from grpo.training.recipes.dpo.reference_cache import reference_logprobs
from grpo.training.recipes.sft.data import SftDataError
from grpo.training.recipes.sft.recipe import (
    DataRecipe,
    check_data_files,
    dry_run_data_recipe,
    encoded_split,
    evaluations,
    run_data_recipe,
    saves,
)
from grpo.training.rollouts.clients import Tokenizer
from grpo.training.run import run_files
from grpo.training.run.init_from import init_state_path
from grpo.training.run.lifecycle import (
    NonFiniteUpdate,
    RunResult,
    retry,
)
from grpo.training.run.recipe import DryRunOptions, RunOptions, Session
from grpo.training.run.state import RunState
from grpo.training.settings.config import SERVICE_BACKENDS
from grpo.training.settings.fields import ConfigError
from grpo.training.settings.prices import prices_for

__all__ = ["DpoPlan", "dpo", "dry_run_dpo", "pair_datums"]


@attrs.frozen
class DpoPlan:
    """What the pre-flight built: the encoded pairs, every step's pairs, the reference."""

    config: DpoConfig
    service: ServiceClient
    train: list[PreferencePair]
    eval: list[PreferencePair]
    batches: list[np.ndarray]
    """Pair indices into ``train`` of every step."""
    reference: str
    """What the reference is: a weights path, or ``base:<model>``."""
    ref_sampler: Sampler
    init_state: str | None
    """The --init-from run's final training state (None: a fresh LoRA)."""
    prices: Prices | None
    notes: tuple[str, ...] = ()
    """What the pre-flight warns of (pairs left out); the run and the dry run say them."""

    @property
    def steps(self) -> int:
        """Optimizer steps of the whole run."""
        return len(self.batches)

    def describe(self, start: int) -> tuple[list[str], TokenUsage]:
        """Its dry-run lines from step ``start``, and its usage from there."""
        config = self.config
        usage = planned_usage(self, start)
        s = config.settings
        lines = [
            f"dry run of {config.run_dir}: every check passed; no training run was created",
            f"  backend {config.backend}, model {config.base_model}, reference {self.reference}",
            f"  data: {len(self.train)} train / {len(self.eval)} held-out pairs",
            f"  plan: steps {start}..{self.steps} of {self.batches[0].size} pairs, loss "
            f"{s.loss} (beta {s.beta:g}, label smoothing {s.label_smoothing:g}, sft weight "
            f"{s.sft_weight:g}), lr {config.learning_rate:g} {config.lr_schedule} after "
            f"{config.warmup_steps} warm-up",
            f"  reference tokens (prompt)  {usage.prompt_tokens:>12,}  exact, paid once (cached)",
            f"  trained tokens (positions) {usage.trained_tokens:>12,}  exact",
            f"  forward-only tokens        {usage.forward_tokens:>12,}  exact",
            *(f"  note: {note}" for note in self.notes),
        ]
        return lines, usage


def example_datum(example: SftExample) -> Datum:
    """tokens[:-1] predicting tokens[1:]; the loss reads the mask, so targets are all it needs."""
    tokens = example.tokens_T
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": TensorData.from_numpy(tokens[1:])},
    )


def pair_datums(pairs: list[PreferencePair]) -> list[Datum]:
    """Two datums a pair, chosen then rejected, pair after pair."""
    return [example_datum(e) for pair in pairs for e in (pair.chosen, pair.rejected)]


def pair_loss(
    config: DpoConfig, pairs: list[PreferencePair], ref_P2: np.ndarray, divisor: str = "sum"
) -> DpoLoss:
    """The loss_fn of ``pairs`` with their reference log-probs ``ref_P2`` (chosen, rejected),
    pre-scaled for a service that divides its gradient by ``divisor``."""
    masks = [e.mask_T[1:] for pair in pairs for e in (pair.chosen, pair.rejected)]
    return as_dpo_loss(config.settings, masks, ref_P2[:, 0], ref_P2[:, 1], divisor)


def _encoded(
    tokenizer: Tokenizer, path: str, max_len: int | None, notes: list[str]
) -> list[PreferencePair]:
    try:
        pairs = load_pairs(tokenizer, path)
    except SftDataError as error:
        raise ConfigError(str(error)) from None
    for number, pair in enumerate(pairs, start=1):
        for column, example in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            if max_len is not None and example.tokens_T.size > max_len:
                raise ConfigError(
                    f"{path} row {number}: the prompt with its {column!r} completion has "
                    f"{example.tokens_T.size} tokens, more than the model's context of "
                    f"{max_len}; shorten it or drop the row"
                )
    return _without_degenerate(pairs, path, notes)


def _without_degenerate(
    pairs: list[PreferencePair], path: str, notes: list[str]
) -> list[PreferencePair]:
    """The pairs whose chosen and rejected differ once encoded; ConfigError when none do,
    a note of how many (and which rows) are left out when some do not."""
    rows = [number for number, pair in enumerate(pairs, start=1) if pair.is_degenerate]
    same = "the chosen completion identical to the rejected one once encoded"
    if not rows:
        return pairs
    if len(rows) == len(pairs):
        raise ConfigError(
            f"{path}: all {len(pairs)} pairs have {same}: there is no preference to learn "
            "(the loss would stay at log 2); check that 'chosen' and 'rejected' hold "
            "different completions"
        )
    shown = ", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
    notes.append(
        f"{path}: {len(rows)} of {len(pairs)} pairs have {same} (rows {shown}): they teach "
        "no preference and are left out"
    )
    return [pair for pair in pairs if not pair.is_degenerate]


def resolve_reference(config: DpoConfig, service: ServiceClient) -> tuple[str, Sampler]:
    """(what the reference is, its sampler): --ref, else the --init-from run, else the base."""
    source = config.ref or config.init_from
    if source is None:
        sampler = service.create_sampling_client(base_model=config.base_model)
        return f"base:{config.base_model}", sampler
    flag = "--ref" if config.ref else "--init-from"
    path = Path(source).expanduser()
    weights = source
    if is_run_dir(path):
        if path.resolve() == Path(str(config.run_dir)).resolve():
            raise ConfigError(f"{flag} {source} is this run itself; name another run")
        try:
            weights = run_files.eval_weights_path(path)
        except run_files.RunDirError as error:
            raise ConfigError(f"{flag} {source}: {error}") from None
    return weights, weights_sampler(service, config.base_model, weights, source, flag)


def preflight_dpo(config: DpoConfig, make_service: Callable[[], ServiceClient]) -> DpoPlan:
    """Prices, --init-from, the pairs (read, encoded, split, batched), the reference's sampler:
    all before the first training call."""
    prices = prices_for(config)  # type: ignore[arg-type]  # reads base_model and price_*
    check_data_files(config)
    init_state = init_state_path(config) if config.init_from else None  # type: ignore[arg-type]
    service = make_service()
    tokenizer = service.create_sampling_client(base_model=config.base_model).get_tokenizer()
    notes: list[str] = []
    train, held = encoded_split(
        config, tokenizer, lambda tok, path, max_len: _encoded(tok, path, max_len, notes)
    )
    steps = config.steps or steps_of_one_pass(len(train), config.batch_size)
    batches = pair_batches(len(train), batch_size=config.batch_size, steps=steps, seed=config.seed)
    reference, ref_sampler = resolve_reference(config, service)
    return DpoPlan(
        config,
        service,
        train,
        held,
        batches,
        reference,
        ref_sampler,
        init_state,
        prices,
        tuple(notes),
    )


def planned_usage(plan: DpoPlan, start_step: int = 0, cached: int = 0) -> TokenUsage:
    """The run's exact usage from ``start_step``: trained positions (PyTRIO's SDK forwards them
    once more), the reference's tokens (less ``cached``), evaluations, checkpoint checks."""
    positions = [pair.num_positions for pair in plan.train]
    per_step = [sum(positions[i] for i in batch) for batch in plan.batches]
    trained = sum(per_step[start_step:])
    evals = evaluations(plan.config, start_step, plan.steps, bool(plan.eval))
    checks = sum(
        per_step[done - 1]
        for done in range(start_step + 1, plan.steps + 1)
        if saves(plan.config, done, plan.steps)
    )
    sdk_forward = trained if plan.config.backend in SERVICE_BACKENDS else 0
    reference = sum(pair.num_tokens for pair in [*plan.train, *plan.eval]) - cached
    per_eval = sum(pair.num_positions for pair in plan.eval)
    return TokenUsage(
        prompt_tokens=reference if start_step == 0 else 0,
        trained_tokens=trained,
        forward_tokens=sdk_forward + evals * per_eval + checks,
    )


def dry_run_dpo(config: DpoConfig, **options: Unpack[DryRunOptions]) -> list[str]:
    """`grpo dpo --dry-run`: every check of a run, then its plan; nothing is written."""
    return dry_run_data_recipe(resolve_dpo_run(config), "dpo", preflight_dpo, **options)


def dpo(config: DpoConfig, **options: Unpack[RunOptions]) -> RunResult:
    """Preference optimization for --steps steps over --data's pairs (or continue it)."""
    config = resolve_dpo_run(config)

    def begin(plan: DpoPlan, session: Session) -> tuple[DpoRecipe, TokenUsage]:
        for note in plan.notes:
            session.note(note)
        ref_N, sent = reference_logprobs(  # once per sequence; a resume reads the cache
            Path(str(config.run_dir)),
            plan.reference,
            plan.ref_sampler,
            [e for pair in [*plan.train, *plan.eval] for e in (pair.chosen, pair.rejected)],
            concurrency=config.concurrency,
            max_retries=config.max_retries,
            note=session.note,
        )
        ref_P2 = ref_N.reshape(-1, 2)
        train, held_out = ref_P2[: len(plan.train)], ref_P2[len(plan.train) :]
        return DpoRecipe(plan, session, train, held_out), TokenUsage(prompt_tokens=sent)

    return run_data_recipe(
        config,
        "dpo",
        dpo_to_dict(config),
        preflight_dpo,
        begin,
        **options,
    )


class DpoRecipe(DataRecipe):
    """Preference optimization as the lifecycle drives it: --batch-size pairs a step."""

    command = "dpo"
    progress_label = "dpo"
    steps_word = "DPO steps"
    plan: DpoPlan

    def __init__(
        self, plan: DpoPlan, session: Session, ref_train_P2: np.ndarray, ref_eval_P2: np.ndarray
    ) -> None:
        super().__init__(plan, session)
        self.ref_train_P2, self.ref_eval_P2 = ref_train_P2, ref_eval_P2

    def step(self, state: RunState, step: int) -> dict[str, float]:
        """One batch of pairs: forward_backward_custom (the DPO loss), then optim_step."""
        config, plan, client = self.config, self.plan, self.session.training_client
        rows = plan.batches[step]
        pairs = [plan.train[i] for i in rows]
        datums = pair_datums(pairs)  # 1. chosen and rejected of each pair: two datums
        # 2. the kernel as loss_fn, pre-scaled for the service's divisor
        loss_fn = pair_loss(config, pairs, self.ref_train_P2[rows], self.divisor)
        result = retry(  # 3. forward_backward_custom: the policy's log-probs, the gradient
            self.session,
            lambda: client.forward_backward_custom(datums, loss_fn).result(),
            "forward_backward_custom",
        )
        state.weights_dirty = True  # the gradient is in: these weights are past the logged step
        with torch.no_grad():  # 4. dpo/* from the log-probs the call returned (every backend)
            _, metrics = loss_fn.of(torch.from_numpy(output_logprobs(result.loss_fn_outputs)))
        if not np.isfinite(metrics["dpo/loss"]):
            raise NonFiniteUpdate(
                f"the DPO loss of step {step + 1} is {metrics['dpo/loss']}: the trainer's "
                "log-probs are not finite (diverged weights?); lower --learning-rate"
            )
        rate, optim = self.optim_step(step)  # 5. optim_step at the step's learning rate
        state.probe_datums = datums  # a checkpoint checks these are finite
        positions = sum(pair.num_positions for pair in pairs)
        trained = sum(pair.chosen.num_trained + pair.rejected.num_trained for pair in pairs)
        state.usage += TokenUsage(  # a service's SDK runs a custom loss as forward + backward
            trained_tokens=positions,
            forward_tokens=positions if config.backend in SERVICE_BACKENDS else 0,
        )
        return {  # 6. the step's metrics
            **metrics,
            "learning_rate": rate,
            "pairs": float(len(pairs)),
            "train_tokens": float(trained),
            "positions": float(positions),
            "grad_norm": float(optim.metrics.get("grad_norm", float("nan"))),
        }

    def evaluate(self, state: RunState) -> dict[str, float]:
        """eval/dpo/*: the kernel's loss and metrics over every held-out pair (forward only)."""
        client, held, size = self.session.training_client, self.plan.eval, self.config.batch_size
        logprobs = []
        for start in range(0, len(held), size):
            datums = pair_datums(held[start : start + size])
            result = retry(
                self.session,
                lambda datums=datums: client.forward(datums, loss_fn="cross_entropy").result(),
                "forward (eval)",
            )
            logprobs.append(output_logprobs(result.loss_fn_outputs))
            state.usage += TokenUsage(forward_tokens=sum(len(d.model_input) for d in datums))
        with torch.no_grad():
            _, metrics = pair_loss(self.config, held, self.ref_eval_P2).of(
                torch.from_numpy(np.concatenate(logprobs))
            )
        return {f"eval/{key}": value for key, value in metrics.items()}

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """Step, loss, accuracy and margin (train and held-out), learning rate and cost."""
        parts = [f"step {step}/{self.plan.steps}"]
        for key in ("dpo/loss", "dpo/accuracy", "dpo/margin"):
            for shown in (key, f"eval/{key}"):
                if shown in metrics:
                    parts.append(f"{shown}={metrics[shown]:.4f}")
        if "learning_rate" in metrics:
            parts.append(f"learning_rate={metrics['learning_rate']:.2e}")
        if "cost/cum" in metrics:
            parts.append(f"cost={metrics['cost/cum']:.4f}")
        return " | ".join(parts)

    def summary(self, state: RunState) -> run_files.JsonObject:
        """The recipe, its reference and its final held-out accuracy and margin."""
        last = state.last_metrics
        return {
            "recipe": "dpo",
            "reference": self.plan.reference,
            **{key: last.get(key) for key in ("eval/dpo/accuracy", "eval/dpo/margin")},
        }
