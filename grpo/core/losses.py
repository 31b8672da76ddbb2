"""Vectorized policy-gradient loss kernels over a packed token batch (docs/FORMULAS.md).

Every kernel takes flat 1-D tensors over all target positions of a batch and returns
``(loss, metrics)``; the loss is the negative aggregated objective. Notation:
``r = exp(lp - lp_old)``, ``sg`` = stop-gradient, ``m`` = mask, ``A`` = advantage.

Supported losses (name: per-token objective o_t; config keys and defaults):

- ``importance_sampling``: ``r·A``; no config.
- ``ppo``: ``min(r·A, clip(r, lo, hi)·A)``, with dual clip ``c`` on ``A < 0`` tokens
  ``max(min(r·A, clip(r, lo, hi)·A), c·A)``; ``clip_low_threshold`` 0.8,
  ``clip_high_threshold`` 1.2, ``dual_clip`` None (off). DAPO clip-higher is ``ppo``
  with a larger ``clip_high_threshold`` (e.g. 1.28) and ``token_mean``.
- ``cispo``: ``sg(clip(r, lo, hi))·lp·A``; ``clip_low_threshold`` 0.0,
  ``clip_high_threshold`` 4.0.
- ``dro``: ``lp·A − (β/2)·(lp − lp_old)²``; ``beta`` 0.05.
- ``gspo`` (sequence level): ``s_i = exp(mean_{t∈i} (lp − lp_old))``, objective
  ``min(s_i·A_i, clip(s_i, lo, hi)·A_i)`` with ``A_i`` the mean advantage over the
  sequence's masked-in tokens (its one advantage, repeated); ``clip_low_threshold``
  1 − 3e-4, ``clip_high_threshold`` 1 + 4e-4.
- ``cross_entropy``: ``w·lp`` with per-token weights ``w`` in place of ``A``; no config.

The loss aggregates the per-unit objective under a reduction (``grpo.core.reductions``:
``sum`` by default, ``token_mean``, ``seq_mean_*``). The inputs are checked and packed by
``grpo.core.packing``: masked positions contribute nothing whatever they hold, a NaN or
±inf at a masked-in position or a non-binary mask raises a ValueError naming the tensor
and index, and float16/bfloat16 inputs are computed in float32.

The loss is differentiable with respect to ``logprobs`` only (lp_old, A and the mask are
constants). Each kernel computes its gradient in closed form together with the loss
(the formulas' "gradients that follow"), on plain tensors and in place where it owns
them, and attaches it with a one-multiply backward; double backward is not supported.
At millions of tokens this is several times faster than letting autograd record every
elementwise step (``benchmarks/losses.py``).

The objectives live in ``grpo.core.loss_objectives``, the gradient in
``grpo.core.loss_gradient``, the compiled path in ``grpo.core.compiled_losses``; this
module is the registry that names them.

The token-level policy kernels also have a single-pass form (``fused_losses``) that
``torch.compile`` turns into one vectorized loop: ``fused=None`` (the default) runs it on
CPU batches of at least ``FUSED_MIN_TOKENS`` positions, where it is several times faster
again; its first call compiles for a few seconds (once per process, dtype and variant).
``fused=True`` forces it, ``fused=False`` keeps the eager kernel; where torch.compile
fails the eager kernel runs, after one RuntimeWarning. ``gspo`` (sequence-level) and
``cross_entropy`` (two inner products: eager is as fast) have no fused form.

Metrics are over masked-in tokens (over sequences with ``n_i > 0`` for ``gspo``):
``loss``, ``train_tokens``, ``ratio_mean``/``ratio_min``/``ratio_max`` (0.0 when nothing
is selected), ``clip_fraction`` (share whose gradient the clip removed or reweighted),
``clip_low_fraction`` (r < lo), ``clip_high_fraction`` (r > hi); ``cispo`` adds
``clipped_ratio_mean``. ``cross_entropy`` without sampling log-probs reports only
``loss`` and ``train_tokens``.

``REDUCTIONS`` (``grpo.core.reductions``) and ``KL_ESTIMATORS`` (``grpo.core.kl``) are
re-exported here with ``LOSSES``: this module stays the one place the shell reads the
named choices of the loss from (``--loss-fn``, ``--reduction``, ``--kl-estimator``), and
``grpo train --help`` names ``grpo.core.losses.REDUCTIONS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeAlias

import attrs
import torch
from torch import Tensor

from grpo.core import fused_losses
from grpo.core.compiled_losses import FUSED_MIN_TOKENS, run_fused
from grpo.core.fused_losses import FusedTerms
from grpo.core.kl import KL_ESTIMATORS
from grpo.core.loss_gradient import KnownGradient, loss_gradient, loss_metrics
from grpo.core.loss_objectives import (
    Terms,
    cispo_objective,
    cross_entropy_objective,
    dro_objective,
    gspo_objective,
    importance_sampling_objective,
    ppo_objective,
)
from grpo.core.packing import Inputs, pack_finite, validate
from grpo.core.reductions import REDUCTIONS, aggregate, validate_reduction

if TYPE_CHECKING:
    from grpo.core.packing import SeqLens

__all__ = [
    "KL_ESTIMATORS",
    "LOSSES",
    "FUSED_MIN_TOKENS",
    "REDUCTIONS",
    "LossKernel",
    "cispo",
    "cross_entropy",
    "dro",
    "get_loss",
    "gspo",
    "importance_sampling",
    "ppo",
    "resolve_config",
]

LossConfig: TypeAlias = dict[str, float | None]


# --- the registry ----------------------------------------------------------------------


def _freeze_defaults(defaults: Mapping[str, float | None]) -> Mapping[str, float | None]:
    return MappingProxyType(dict(defaults))


@attrs.frozen(slots=False)
class LossKernel:
    """A named loss: its config defaults and its objective (with slope and clip counts).

    Calling it runs the whole kernel:
    ``loss, metrics = kernel(logprobs, sampling_logprobs, advantages, *, mask=None,
    seq_lens=None, reduction="sum", norm_length=None, fused=None, **config)``.
    """

    name: str
    defaults: Mapping[str, float | None] = attrs.field(converter=_freeze_defaults)
    sequence_level: bool
    objective: Callable[..., Terms] = attrs.field(repr=False)
    weight_input: str = "advantages"
    """The datum ``loss_fn_inputs`` key holding the per-token weight (A, or w for CE)."""
    needs_sampling_logprobs: bool = True
    """Whether the objective uses lp_old (cross_entropy only reports ratios when given it)."""
    fused_form: Callable[..., FusedTerms] | None = attrs.field(default=None, repr=False)
    """The single-pass form for torch.compile (``fused_losses``), None if there is none."""
    service_builtin: bool = True
    """Whether PyTRIO's ``forward_backward`` has this loss built in (else: as a custom loss)."""
    weight_scaled_keys: tuple[str, ...] = ()
    """Config keys that scale with the weights: for c > 0, the loss on weights c·w with these
    keys times c is c times the loss on w (DRO's β; every other objective is positively
    homogeneous in its weight). ``LossSpec.scaled`` reads it."""

    def __attrs_post_init__(self) -> None:
        # The instance's docstring is its formula, so help(losses.ppo) states the math.
        object.__setattr__(self, "__doc__", self.objective.__doc__)

    def resolve(self, config: Mapping[str, object]) -> LossConfig:
        """Defaults merged with ``config``, validated (unknown keys and bad thresholds raise)."""
        unknown = sorted(set(config) - set(self.defaults))
        if unknown:
            valid = (
                ", ".join(sorted(self.defaults)) if self.defaults else "none (it takes no config)"
            )
            raise ValueError(
                f"unknown config key {unknown[0]!r} for loss {self.name!r}; valid keys: {valid}"
            )
        resolved: LossConfig = {}
        for key, default in self.defaults.items():
            value = config.get(key, default)
            if value is None and default is None:
                resolved[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number for loss {self.name!r}, got {value!r}")
            if math.isnan(value):
                raise ValueError(f"{key} must be a number for loss {self.name!r}, got nan")
            resolved[key] = float(value)
        _validate_thresholds(self.name, resolved)
        return resolved

    def __call__(
        self,
        logprobs: Tensor,
        sampling_logprobs: Tensor | None,
        advantages: Tensor,
        *,
        mask: Tensor | None = None,
        seq_lens: SeqLens | None = None,
        reduction: str = "sum",
        norm_length: float | None = None,
        fused: bool | None = None,
        **config: float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss −aggregate(o) under ``reduction`` and float metrics over masked-in units.

        The loss is differentiable w.r.t. ``logprobs`` only (lp_old, A and the mask are
        constants); its gradient is computed here, in closed form, with the loss.
        ``fused``: None runs the compiled single-pass form on CPU batches of at least
        ``FUSED_MIN_TOKENS`` positions (where it wins), True runs it at any size (under
        ``FUSED_MAX_TOKENS``) and device, False never; the eager kernel runs otherwise, and
        whenever the batch selects nothing or torch.compile fails here (with a warning). A
        non-finite masked-in value or a non-binary mask raises ValueError naming the tensor
        and index.
        """
        resolved = self.resolve(config)
        validate_reduction(reduction, norm_length)
        if sampling_logprobs is None and self.needs_sampling_logprobs:
            raise ValueError(
                f"loss {self.name!r} needs sampling_logprobs (the sampler's log-probs), got None"
            )
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (auto), True or False, got {fused!r}")
        inputs = validate(
            logprobs, sampling_logprobs, advantages, mask, seq_lens, self.weight_input
        )
        form = self._fused_form_for(inputs, fused)
        if form is not None:
            result = run_fused(form, inputs, logprobs, reduction, norm_length, resolved)
            if result is not None:
                return result
        tokens = pack_finite(inputs)
        units = tokens.per_sequence() if self.sequence_level else tokens
        terms = self.objective(units, **resolved)
        total, derivative = aggregate(terms.objective, units, reduction, norm_length)
        loss = total.neg_()
        if logprobs.requires_grad and torch.is_grad_enabled():
            gradient = loss_gradient(terms, derivative, tokens, units)
            # Autograd would cast a float32 gradient too, but only at backward: casting now
            # holds half the memory until then and hands over the tensor without a copy.
            loss = KnownGradient.apply(logprobs, loss, gradient.to(logprobs.dtype))
        device = logprobs.device
        return loss, loss_metrics(
            loss, units.unit_count, units.token_count, terms.statistics, device
        )

    def _fused_form_for(
        self, inputs: Inputs, fused: bool | None
    ) -> Callable[..., FusedTerms] | None:
        """The fused form this call should run, or None for the eager kernel."""
        if fused is False:
            return None
        form = self.fused_form
        if form is None:
            if fused:
                raise ValueError(
                    f"loss {self.name!r} has no fused form (fused forms: "
                    f"{', '.join(name for name, k in LOSSES.items() if k.fused_form)}); "
                    "pass fused=None or fused=False"
                )
            return None
        # Nothing selected, or a single position: the eager kernel's special cases.
        if inputs.count == 0 or inputs.logprobs.numel() < 2:
            return None
        if fused is None and (
            inputs.logprobs.device.type != "cpu" or inputs.logprobs.numel() < FUSED_MIN_TOKENS
        ):
            return None
        return form


def _validate_thresholds(name: str, config: LossConfig) -> None:
    for key in ("clip_low_threshold", "clip_high_threshold", "beta"):
        value = config.get(key)
        if value is not None and value < 0:
            raise ValueError(f"{key} must be >= 0 for loss {name!r}, got {value}")
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"clip_low_threshold ({low}) must not exceed clip_high_threshold ({high}) "
            f"for loss {name!r}; they are absolute ratio bounds, e.g. 0.8 and 1.2"
        )
    beta = config.get("beta")
    if beta is not None and not math.isfinite(beta):
        raise ValueError(f"beta must be finite for loss {name!r}, got {beta}")
    dual_clip = config.get("dual_clip")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(
            f"dual_clip must be > 1 for loss {name!r}, got {dual_clip}; "
            "use e.g. 3.0, or None to turn it off"
        )


importance_sampling = LossKernel(
    name="importance_sampling",
    defaults={},
    sequence_level=False,
    objective=importance_sampling_objective,
    fused_form=fused_losses.fused_importance_sampling,
)
ppo = LossKernel(
    name="ppo",
    defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "dual_clip": None},
    sequence_level=False,
    objective=ppo_objective,
    fused_form=fused_losses.fused_ppo,
)
cispo = LossKernel(
    name="cispo",
    defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    sequence_level=False,
    objective=cispo_objective,
    fused_form=fused_losses.fused_cispo,
)
dro = LossKernel(
    name="dro",
    defaults={"beta": 0.05},
    sequence_level=False,
    objective=dro_objective,
    fused_form=fused_losses.fused_dro,
    weight_scaled_keys=("beta",),
)
gspo = LossKernel(
    name="gspo",
    defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    sequence_level=True,
    objective=gspo_objective,
    service_builtin=False,
)
cross_entropy = LossKernel(
    name="cross_entropy",
    defaults={},
    sequence_level=False,
    objective=cross_entropy_objective,
    weight_input="weights",
    needs_sampling_logprobs=False,
)

LOSSES: Mapping[str, LossKernel] = MappingProxyType(
    {kernel.name: kernel for kernel in (importance_sampling, ppo, cispo, dro, gspo, cross_entropy)}
)


def get_loss(name: str) -> LossKernel:
    """The registered kernel called ``name``; ValueError listing the known names otherwise."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}"
        ) from None


def resolve_config(name: str, config: Mapping[str, object]) -> LossConfig:
    """Kernel ``name``'s defaults merged with ``config`` after validating keys and thresholds."""
    return get_loss(name).resolve(config)
