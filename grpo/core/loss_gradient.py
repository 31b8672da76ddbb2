"""A loss kernel's gradient w.r.t. ``logprobs``, computed in closed form with the loss.

``loss_gradient`` turns an objective's slope into d loss/d lp per token; ``KnownGradient``
attaches it to the loss with a one-multiply backward (double backward is not supported);
``loss_metrics`` reads the objective's statistics into the kernel's float metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from grpo.core.loss_objectives import Terms
from grpo.core.packing import Units

__all__ = ["KnownGradient", "loss_gradient", "loss_metrics"]


def loss_gradient(terms: Terms, derivative: float | Tensor, tokens: Units, units: Units) -> Tensor:
    """d loss/d lp per token: −(dΣ/do)·slope, spread over the tokens of sequence units.

    For a sequence unit, d(mean_{t∈i} log-ratio)/d lp_t = m_t / n_i.
    """
    slope = terms.slope() if callable(terms.slope) else terms.slope
    if isinstance(derivative, float):
        gradient = slope.mul_(-derivative) if terms.slope_is_scratch else slope * -derivative
    else:
        gradient = (slope.mul_(derivative) if terms.slope_is_scratch else slope * derivative).neg_()
    if units.tokens_per_unit is None:
        return gradient
    per_token = torch.repeat_interleave(
        gradient.div_(units.tokens_per_unit),
        tokens.seq_lens,
        output_size=tokens.advantages.numel(),
    )
    return per_token if tokens.mask is None else per_token.mul_(tokens.mask)


class KnownGradient(torch.autograd.Function):
    """A loss whose gradient w.r.t. logprobs is already computed: backward is one multiply."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, logprobs: Tensor, loss: Tensor, gradient: Tensor
    ) -> Tensor:
        # Held as an attribute, not saved: backward hands it over as the only reference,
        # so autograd makes it the leaf's .grad instead of copying it (32 MiB at 8M tokens).
        ctx.gradient = gradient  # type: ignore[attr-defined]
        return loss.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor
    ) -> tuple[Tensor, None, None]:
        gradient = ctx.__dict__.pop("gradient", None)
        if gradient is None:
            raise RuntimeError(
                "this loss's gradient was already handed to an earlier backward; call the "
                "kernel again instead of backward(retain_graph=True) a second time"
            )
        if gradient.device.type == "cpu" and grad_loss.item() == 1:
            return gradient, None, None  # loss.backward() seeds 1
        return gradient.mul_(grad_loss), None, None


@torch.no_grad()
def loss_metrics(
    loss: Tensor,
    unit_count: int,
    token_count: int,
    statistics: Mapping[str, Tensor | int],
    device: torch.device,
) -> dict[str, float]:
    """Loss, token count, ratio statistics and clip shares over the selected units."""
    metrics = {"loss": float(loss), "train_tokens": float(token_count)}
    if not statistics:
        return metrics
    per_unit = float(max(unit_count, 1))
    names = list(statistics)
    if device.type == "cpu":
        # On CPU a value is read in ~1 us; the stacked transfer below costs ~40.
        totals = [float(value) for value in statistics.values()]
    else:
        # One transfer for all statistics: a device sync each would cost more than the loss.
        totals = torch.stack(
            [
                torch.as_tensor(value, dtype=torch.float64, device=device)
                for value in statistics.values()
            ]
        ).tolist()
    for name, total in zip(names, totals, strict=True):
        # Extremes are values; every other statistic is a sum over the selected units.
        metrics[name] = total if name in ("ratio_min", "ratio_max") else total / per_unit
    return metrics
