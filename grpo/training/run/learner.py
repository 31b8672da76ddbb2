"""The learner: how a recipe's batch becomes weight updates, with what a step needs around them.

``update`` runs docs/DESIGN.md's steps 8-9 (epochs x minibatches of forward_backward, or
forward_backward_custom, then optim_step; the kernel's metrics from the returned
log-probs), after the optional mismatch correction (``correct_for_mismatch``: one forward
for the trainer's log-probs at the step's start) and KL shaping (``shape_with_kl``, step 7).
``current_sampler`` refreshes the sampler once per update; ``retry`` is every call's retry
of transient backend errors. Every recipe that trains on sampled tokens (GRPO, distillation,
on completions or episodes) updates through here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import attrs
import numpy as np
from pytrio.types import Datum, ForwardBackwardOutput

from grpo.backends.clients import Future, TrainingClient
from grpo.backends.datums import (
    batch_to_datums,
    datum_totals,
    forward_only,
    output_logprobs,
    scale_weights,
)
from grpo.backends.pytrio import call_with_retries
from grpo.core.advantages import kl_shaped_advantages
from grpo.core.alignment import minibatches
from grpo.core.loss_spec import LossSpec
from grpo.core.metrics import mismatch_metrics, update_metrics
from grpo.core.mismatch import correct_batch
from grpo.core.records import TokenBatch
from grpo.core.usage import TokenUsage, training_usage
from grpo.training.custom_loss import as_custom_loss
from grpo.training.rollouts.clients import Sampler
from grpo.training.run.faults import fault_point
from grpo.training.run.lifecycle import NonFiniteUpdate
from grpo.training.run.state import Run, RunState
from grpo.training.run.timing import timed
from grpo.training.settings.config import TrainConfig

T = TypeVar("T")


def runs_extra_forward(config: TrainConfig) -> bool:
    """PyTRIO's and Tinker's SDKs run a custom loss as a forward, then a forward_backward
    (one pass locally)."""
    return config.runs_custom_loss and config.backend in ("pytrio", "tinker")


def retry(run: Run, call: Callable[[], T], what: str) -> T:
    """``call()`` with the run's retries of transient backend errors (--max-retries)."""
    return call_with_retries(call, what=what, max_retries=run.config.max_retries, note=run.note)


def current_sampler(run: Run, state: RunState) -> Sampler:
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
            submit = loss_submission(
                client,
                spec,
                datums,
                custom=config.runs_custom_loss,
                normalization=run.service_normalization,
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


def loss_submission(
    client: TrainingClient,
    spec: LossSpec,
    datums: list[Datum],
    *,
    custom: bool,
    normalization: str,
) -> Callable[[], Future[ForwardBackwardOutput]]:
    """The call that trains `spec` on `datums` so the gradient applied is the loss's own when
    the service divides by D (`normalization`, docs/FORMULAS.md "Service normalization"):
    built-in, the weights and the kernel's weight-scaled keys times D (the datums' totals);
    custom (``forward_backward_custom``), the loss times D (its surrogate's totals)."""
    if custom:
        loss_fn = as_custom_loss(spec, datums, service_normalization=normalization)
        stripped = forward_only(datums)
        return lambda: client.forward_backward_custom(stripped, loss_fn)
    divisor = datum_totals(datums, loss_fn=spec.name).denominator(normalization)
    scaled = scale_weights(datums, divisor, spec.kernel.weight_input)
    loss_fn_config = spec.scaled(divisor).to_loss_fn_config()
    return lambda: client.forward_backward(scaled, loss_fn=spec.name, loss_fn_config=loss_fn_config)


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
