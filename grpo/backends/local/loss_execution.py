"""The local training client's loss execution: validation, the loss on the model, its checks.

``prepare_loss_batch`` validates a ``forward``/``forward_backward`` request (PyTRIO's
checks, the loss config, the datums as flat arrays) before anything is computed;
``run_loss`` runs a built-in loss's core kernel on the model's log-probs and
``run_custom_loss`` a user's loss on log-prob leaves, its gradient pushed through the
model (both on the worker thread); outputs and metrics are packed as PyTRIO's. Every
refusal of non-finite numbers (log-probs, a loss, a custom-loss gradient) and the
validation of ``AdamParams`` live here, raised before anything changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import ValidationError
from pytrio.model.limits import TrainingLimits
from pytrio.types import AdamParams, Datum, ForwardBackwardOutput, ImageChunk, TensorData
from torch import Tensor

from grpo.backends.datums import (
    IGNORE_INDEX,
    DatumArrays,
    datum_array,
    read_datums,
    surrogate_totals,
)
from grpo.backends.local.model import ModelHost
from grpo.backends.local.shared_prefix import target_logprobs
from grpo.core.loss_spec import LossSpec
from grpo.core.normalization import BatchTotals

CustomLossFn = Callable[..., tuple[Tensor, dict[str, float]]]


@attrs.frozen
class LossBatch:
    """A validated forward/forward_backward request: the loss and the datums as flat arrays."""

    spec: LossSpec
    auto_shift: bool
    inputs: list[list[int]]
    arrays: DatumArrays
    totals: BatchTotals  # of these datums, by pytrio's planner (the reported token_count)


def prepare_loss_batch(
    data: list[Datum],
    loss_fn: str,
    loss_fn_config: dict[str, object] | None,
    auto_shift: bool,
    *,
    limits: TrainingLimits,
    vocab_size: int,
) -> LossBatch:
    """PyTRIO's validation, then the loss config, then flat arrays; all before any compute."""
    plan = plan_training_batch(
        data,
        loss_fn=loss_fn,
        auto_shift=auto_shift,
        limits=limits,
        tokenizer_vocab_size=vocab_size,
    )
    _reject_images(data)
    try:
        spec = LossSpec.from_loss_fn_config(loss_fn, loss_fn_config)
    except ValueError as error:
        raise ValidationError(
            f"invalid loss_fn_config for {loss_fn!r}: {error}",
            code="validation.invalid_loss_config",
        ) from None
    # One reader and masking rule for built-in and custom losses: grpo.backends.datums.
    # Cross-entropy weights are optional (absent means 1), and it reports no ratios.
    cross_entropy = spec.name == "cross_entropy"
    try:
        arrays = read_datums(
            data,
            weight_input=spec.kernel.weight_input,
            with_sampling_logprobs=not cross_entropy,
            weights_optional=cross_entropy,
        )
    except ValueError as error:
        raise ValidationError(str(error), code="validation.invalid_datum") from None
    if auto_shift:  # the first label predicts nothing (PyTRIO drops it)
        arrays.mask_N[np.cumsum(arrays.seq_lens_B) - arrays.seq_lens_B] = False
    return LossBatch(
        spec=spec,
        auto_shift=auto_shift,
        inputs=[datum.model_input.to_ints() for datum in data],
        arrays=arrays,
        totals=BatchTotals(
            samples=plan.totals.total_samples,
            active_tokens=plan.totals.total_active_tokens,
            advantage_tokens=plan.totals.total_advantage_tokens,
        ),
    )


def prepare_custom_batch(
    data: list[Datum], *, limits: TrainingLimits, vocab_size: int
) -> tuple[list[list[int]], list[np.ndarray]]:
    """PyTRIO's validation of a forward_backward_custom request, then its inputs and targets."""
    plan_training_batch(
        data,
        loss_fn="cross_entropy",
        auto_shift=False,
        limits=limits,
        tokenizer_vocab_size=vocab_size,
    )
    _reject_images(data)
    inputs = [datum.model_input.to_ints() for datum in data]
    targets = [datum_array(datum, "target_tokens", np.int64) for datum in data]
    return inputs, targets


def run_loss(
    host: ModelHost,
    adapter: str,
    batch: LossBatch,
    *,
    backward: bool,
    with_kernel_metrics: bool,
    normalization: str = "sum",
    totals: BatchTotals | None = None,
) -> ForwardBackwardOutput:
    """The kernel on the model's log-probs (worker thread); backward accumulates the gradient
    of loss x `totals.gradient_scale(normalization)` (`totals`: the logical batch's, sent with
    a micro-batch, else this batch's own). Metrics: pytrio's ``loss_sum``, ``token_count``
    (this batch's active tokens, pytrio's planner's count) and their ratio ``loss_mean``."""
    host.activate_training(adapter)
    arrays, spec = batch.arrays, batch.spec
    sampling = (
        None if arrays.sampling_logprobs_N is None else torch.from_numpy(arrays.sampling_logprobs_N)
    )
    weights, mask = torch.from_numpy(arrays.weights_N), torch.from_numpy(arrays.mask_N)

    def evaluate(logprobs: Tensor, loss: LossSpec) -> tuple[Tensor, dict[str, float]]:
        return loss(logprobs, sampling, weights, mask=mask, seq_lens=arrays.seq_lens_B)

    with torch.enable_grad() if backward else torch.no_grad():
        logprobs_list = target_logprobs(
            host, batch.inputs, arrays.target_tokens_B, auto_shift=batch.auto_shift
        )
        logprobs = torch.cat(logprobs_list)
        _require_finite_logprobs(logprobs, arrays.seq_lens_B)
        loss, kernel_metrics = evaluate(logprobs, spec)
        if backward:
            if not bool(torch.isfinite(loss.detach())):
                raise _non_finite_loss(batch, logprobs.detach(), float(loss.detach()))
            scale = (totals or batch.totals).gradient_scale(normalization)
            (loss if scale == 1.0 else loss * scale).backward()
    if spec.reduction == "sum":
        loss_sum = float(loss.detach())
    else:
        with torch.no_grad():
            summed = attrs.evolve(spec, reduction="sum", norm_length=None)
            loss_sum = float(evaluate(logprobs.detach(), summed)[0])
    token_count = batch.totals.active_tokens
    metrics: dict[str, float] = {
        "loss_sum": loss_sum,
        "loss_mean": loss_sum / token_count if token_count else 0.0,
        "token_count": token_count,
    }
    if with_kernel_metrics:
        prefix = spec.name
        metrics.update({f"{prefix}/{key}": value for key, value in kernel_metrics.items()})
    return ForwardBackwardOutput(loss_fn_outputs=_outputs(logprobs_list), metrics=metrics)


def run_custom_loss(
    host: ModelHost,
    adapter: str,
    data: list[Datum],
    inputs: list[list[int]],
    targets: list[np.ndarray],
    loss_fn: CustomLossFn,
    loss_fn_config: dict[str, object] | None,
    normalization: str = "sum",
) -> ForwardBackwardOutput:
    """Custom loss on log-prob leaves, their gradients pushed through the model (worker),
    scaled as pytrio's cross-entropy surrogate (weights -grad) would be under
    `normalization` (its active tokens: the non-zero gradients; no advantage tokens)."""
    host.activate_training(adapter)
    with torch.enable_grad():
        logprobs_list = target_logprobs(host, inputs, targets, auto_shift=False)
        _require_finite_logprobs(
            torch.cat([logprobs.detach() for logprobs in logprobs_list]),
            [len(target) for target in targets],
        )
        leaves = [logprobs.detach().clone().requires_grad_(True) for logprobs in logprobs_list]
        loss, custom_metrics = _call_custom_loss(loss_fn, data, leaves, loss_fn_config)
        if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            shown = loss.item() if loss.numel() == 1 else loss.detach().flatten()[:4].tolist()
            raise ValidationError(
                f"the custom loss is {shown}, not finite; no gradient was applied: check "
                "loss_fn for a log of 0, a division by 0 or an overflowing exp",
                code="validation.non_finite_custom_loss",
            )
        loss.backward()
        gradients = []
        for leaf, target in zip(leaves, targets, strict=True):
            if leaf.grad is None:
                raise ValidationError(
                    "Custom loss output has no gradients. "
                    "Ensure loss_fn returns a tensor with gradients.",
                    code="validation.missing_custom_loss_gradient",
                )
            # The service trains ignored targets on nothing, whatever the gradient.
            gradients.append(torch.where(torch.from_numpy(target) == IGNORE_INDEX, 0.0, leaf.grad))
        for index, gradient in enumerate(gradients):
            bad = ~torch.isfinite(gradient)
            if bool(bad.any()):
                position = int(bad.nonzero()[0, 0])
                raise ValidationError(
                    f"the custom loss's gradient w.r.t. the log-prob of datum {index}, "
                    f"position {position} is {float(gradient[position])}; no gradient was "
                    "applied: check loss_fn where it is not differentiable (sqrt or log at 0)",
                    code="validation.non_finite_custom_loss_gradient",
                )
        surrogate = surrogate_totals([gradient.numpy() for gradient in gradients], targets)
        scale = surrogate.gradient_scale(normalization)
        pushed = gradients if scale == 1.0 else [gradient * scale for gradient in gradients]
        torch.autograd.backward(logprobs_list, pushed)
    # PyTRIO reports its linear surrogate: cross entropy with weights -grad.
    gradient, logprobs = torch.cat(gradients), torch.cat([lp.detach() for lp in logprobs_list])
    loss_sum = float((gradient * logprobs).sum())
    token_count = int((gradient != 0).sum())
    metrics = {
        "loss_sum": loss_sum,
        "loss_mean": loss_sum / token_count if token_count else 0.0,
        "token_count": token_count,
    }
    return ForwardBackwardOutput(
        loss_fn_outputs=_outputs(logprobs_list), metrics={**metrics, **custom_metrics}
    )


def _reject_images(data: Sequence[Datum]) -> None:
    for index, datum in enumerate(data):
        if any(isinstance(chunk, ImageChunk) for chunk in datum.model_input.chunks):
            raise ValidationError(
                f"datum {index} has image chunks; the local backend trains on text only",
                code="validation.image_unsupported",
            )


def _outputs(logprobs_list: Sequence[Tensor]) -> list[dict[str, TensorData]]:
    return [{"logprobs": TensorData.from_torch(logprobs.detach())} for logprobs in logprobs_list]


def _datum_position(flat: int, seq_lens: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """(datum, position within it) of an index into the concatenated per-datum values."""
    ends = np.cumsum(seq_lens)
    index = int(np.searchsorted(ends, flat, side="right"))
    return index, flat - (int(ends[index - 1]) if index else 0)


def _require_finite_logprobs(logprobs: Tensor, seq_lens: Sequence[int] | np.ndarray) -> None:
    """ValidationError at the first non-finite model log-prob (its datum and position)."""
    values = logprobs.detach()
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    flat = int(bad.nonzero()[0, 0])
    index, position = _datum_position(flat, seq_lens)
    raise ValidationError(
        f"the model's log-prob of datum {index}, position {position} is "
        f"{float(values[flat])}: the LoRA weights have diverged (a learning rate too high?). "
        "Nothing was trained; resume from the last good checkpoint with a lower learning rate",
        code="validation.non_finite_logprobs",
    )


def _non_finite_loss(batch: LossBatch, logprobs: Tensor, value: float) -> ValidationError:
    """The error for a built-in loss that overflowed on finite inputs: the largest log-ratio."""
    culprit = ""
    arrays = batch.arrays
    if arrays.sampling_logprobs_N is not None and arrays.mask_N.any():
        gaps = np.where(arrays.mask_N, logprobs.numpy() - arrays.sampling_logprobs_N, 0.0)
        flat = int(np.argmax(np.abs(gaps)))
        index, position = _datum_position(flat, arrays.seq_lens_B)
        culprit = (
            f"; its largest log-ratio lp − lp_old is {gaps[flat]:.4g} (datum {index}, position "
            f"{position}), and exp(lp − lp_old) overflows float32 above 88"
        )
    return ValidationError(
        f"the {batch.spec.name} loss is {value} on finite inputs{culprit}; no gradient was "
        "applied: use a clipped loss (ppo, cispo) or check that the sampling log-probs come "
        "from the model being trained",
        code="validation.non_finite_loss",
    )


def _call_custom_loss(
    loss_fn: CustomLossFn,
    data: list[Datum],
    logprobs: list[Tensor],
    config: dict[str, object] | None,
) -> tuple[Tensor, dict[str, float]]:
    """PyTRIO's rule: pass `config` only when given and the function accepts a third argument."""
    if config is None:
        return loss_fn(data, logprobs)
    try:
        inspect.signature(loss_fn).bind(data, logprobs, config)
    except (TypeError, ValueError):
        return loss_fn(data, logprobs)
    return loss_fn(data, logprobs, config)


def validate_adam(params: AdamParams) -> None:
    """ValidationError naming the first AdamParams field that is not finite or out of range."""
    checks = (
        ("learning_rate", params.learning_rate, params.learning_rate >= 0, ">= 0"),
        ("beta1", params.beta1, 0 <= params.beta1 < 1, "in [0, 1)"),
        ("beta2", params.beta2, 0 <= params.beta2 < 1, "in [0, 1)"),
        ("eps", params.eps, params.eps > 0, "> 0"),
        ("weight_decay", params.weight_decay, params.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", params.grad_clip_norm, params.grad_clip_norm >= 0, ">= 0 (0 = off)"),
    )
    for field, value, ok, rule in checks:
        if not (np.isfinite(value) and ok):
            raise ValidationError(
                f"adam_params.{field} must be finite and {rule}, got {value!r}",
                code="validation.invalid_adam_params",
            )
