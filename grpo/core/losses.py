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

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import attrs
import torch
from torch import Tensor

from grpo.core import fused_losses
from grpo.core.fused_losses import FusedTerms
from grpo.core.kl import KL_ESTIMATORS
from grpo.core.packing import (
    Inputs,
    Units,
    as_float,
    count_true,
    nonfinite_error,
    pack_finite,
    segment_sum,
    validate,
)
from grpo.core.reductions import (
    REDUCTIONS,
    Products,
    aggregate,
    reduction_derivative,
    validate_reduction,
)

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


# --- per-unit objectives ---------------------------------------------------------------
# Each returns the objective o per unit (0 on masked units), its slope (do/dlp for token
# units, do/d(mean log-ratio) for sequence units) and its statistics over the selected
# units: Σ r, min r, max r (when lp_old is given) and the clip counts. The kernel turns
# the slope into the gradient.


class _Terms(NamedTuple):
    """An objective's per-unit values, their slope and the statistics it reports.

    ``objective`` is o per unit, or a sum of scaled products Σ_k c_k·a_k·b_k: then Σ_u o_u
    is Σ_k c_k·(a_k · b_k), inner products that read their factors once and write
    nothing, and o itself is only formed when a reduction needs it per sequence.
    """

    objective: Tensor | Products
    slope: Tensor | Callable[[], Tensor]  # a callable is only run when a gradient is needed
    statistics: dict[str, Tensor | int]
    slope_is_scratch: bool = True  # False when slope is a caller's tensor: never written


def _log_ratio(units: Units) -> Tensor:
    # LossKernel.__call__ rejects a missing lp_old for every kernel that reads this.
    assert units.log_ratio is not None
    return units.log_ratio


def _logprobs(units: Units) -> Tensor:
    # Only sequence-level units drop lp, and the sequence-level objective never reads it.
    assert units.logprobs is not None
    return units.logprobs


def _ratio_statistics(ratio: Tensor, units: Units) -> dict[str, Tensor | int]:
    """Σ r, min r and max r over the selected units (0 when none is), and zero clip counts."""
    no_clips = {"clip_fraction": 0, "clip_low_fraction": 0, "clip_high_fraction": 0}
    if units.unit_count == 0:
        return {"ratio_mean": 0, "ratio_min": 0, "ratio_max": 0, **no_clips}
    low, high = torch.aminmax(ratio)
    if units.mask is None:
        return {"ratio_mean": ratio.sum(), "ratio_min": low, "ratio_max": high, **no_clips}
    # A masked unit holds r = 1 exactly, so a global extreme other than 1 is a selected
    # unit's; so is 1 when both extremes are 1. Only one extreme at exactly 1 is ambiguous.
    if bool((low == 1.0) ^ (high == 1.0)):
        assert units.selected is not None
        low = torch.where(units.selected, ratio, math.inf).min()
        high = torch.where(units.selected, ratio, 0.0).max()
    ratio_sum = torch.dot(ratio, units.mask)
    return {"ratio_mean": ratio_sum, "ratio_min": low, "ratio_max": high, **no_clips}


def _unclipped_statistics(units: Units) -> dict[str, Tensor | int]:
    """Statistics of an objective without a clip: those of r when lp_old is given, else none.

    Call it last: r is computed in place of the log-ratio.
    """
    if units.log_ratio is None:
        return {}
    return _ratio_statistics(units.log_ratio.exp_(), units)


def _selected_count(outside: Tensor, units: Units, one_is_outside: bool) -> int:
    """How many selected units a ratio test marks, from the test over every unit.

    A masked unit holds r = 1 exactly, so the test marks it only when it marks 1, and the
    count over every unit then exceeds the selected count by exactly the masked units.
    """
    return count_true(outside) - (units.masked_out if one_is_outside else 0)


def _outside_counts(
    ratio: Tensor, units: Units, low: float, high: float
) -> tuple[Tensor, Tensor, int, int]:
    """(r < lo, r > hi) over every unit, and their counts over the selected units."""
    below, above = ratio < low, ratio > high
    below_count = _selected_count(below, units, low > 1)
    return below, above, below_count, _selected_count(above, units, high < 1)


def _clipped_surrogate(
    ratio: Tensor, units: Units, low: float, high: float, dual_clip: float | None
) -> _Terms:
    """min(r·A, clip(r, lo, hi)·A), dual-clipped to max(·, c·A) where A < 0; r is overwritten.

    do/dr is A, except 0 on the clipped side (r > hi with A > 0, r < lo with A < 0) and
    where the dual clip is active; do/dlp = r·do/dr.
    """
    advantages = units.advantages
    statistics = _ratio_statistics(ratio, units)
    below, above, below_count, above_count = _outside_counts(ratio, units, low, high)
    unclipped = ratio * advantages
    objective = ratio.clamp(low, high).mul_(advantages)
    torch.minimum(unclipped, objective, out=objective)
    # Masked units hold A = 0, so the sign tests exclude them without the mask.
    negative = advantages < 0
    clipped_side = (advantages > 0).logical_and_(above).logical_or_(below.logical_and_(negative))
    if dual_clip is None:
        clipped_count = count_true(clipped_side)
    else:
        clipped_count = count_true(clipped_side | negative.logical_and_(ratio > dual_clip))
        # c·min(A, 0) is c·A where A < 0; where A >= 0 it is 0 <= o (r, lo >= 0): a no-op.
        floor = advantages.clamp(max=0).mul_(dual_clip)
        clipped_side.logical_or_(floor > objective)
        torch.maximum(objective, floor, out=objective)
    statistics.update(
        clip_fraction=clipped_count, clip_low_fraction=below_count, clip_high_fraction=above_count
    )

    def slope() -> Tensor:
        # The statistics are taken, so r's buffer can hold the 0/1 keep-weights.
        return unclipped.mul_(as_float(clipped_side.logical_not_(), out=ratio))

    return _Terms(objective=objective, slope=slope, statistics=statistics)


def _importance_sampling_objective(units: Units) -> _Terms:
    """Importance sampling: o_t = r·A, gradient d(−o_t)/d lp = −r·A."""
    ratio = _log_ratio(units).exp_()
    statistics = _ratio_statistics(ratio, units)
    objective = ratio.mul_(units.advantages)
    return _Terms(objective=objective, slope=objective, statistics=statistics)


def _ppo_objective(
    units: Units,
    *,
    clip_low_threshold: float,
    clip_high_threshold: float,
    dual_clip: float | None,
) -> _Terms:
    """PPO: o_t = min(r·A, clip(r, lo, hi)·A); dual clip c: max(o_t, c·A) where A < 0."""
    ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(ratio, units, clip_low_threshold, clip_high_threshold, dual_clip)


def _cispo_objective(
    units: Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> _Terms:
    """CISPO: o_t = sg(clip(r, lo, hi))·lp·A, gradient −clip(r, lo, hi)·A everywhere."""
    ratio = _log_ratio(units).exp_()
    statistics = _ratio_statistics(ratio, units)
    # r >= 0 is never below a bound of 0 (the default): skip that pass.
    below_count = (
        _selected_count(ratio < clip_low_threshold, units, clip_low_threshold > 1)
        if clip_low_threshold > 0
        else 0
    )
    above_count = _selected_count(ratio > clip_high_threshold, units, clip_high_threshold < 1)
    clipped_ratio = ratio.clamp_(clip_low_threshold, clip_high_threshold)
    statistics.update(
        # lo <= hi, so no ratio is both below and above: the counts add up.
        clip_fraction=below_count + above_count,
        clip_low_fraction=below_count,
        clip_high_fraction=above_count,
        clipped_ratio_mean=(
            clipped_ratio.sum() if units.mask is None else torch.dot(clipped_ratio, units.mask)
        ),
    )
    weight = clipped_ratio.mul_(units.advantages)
    return _Terms(objective=((1.0, weight, _logprobs(units)),), slope=weight, statistics=statistics)


def _dro_objective(units: Units, *, beta: float) -> _Terms:
    """DRO: o_t = lp·A − (β/2)·(lp − lp_old)², gradient −A + β·(lp − lp_old)."""
    log_ratio = _log_ratio(units)
    # Formed here, not as products: the statistics then turn the log-ratio into r in place.
    objective = torch.mul(_logprobs(units), units.advantages).addcmul_(
        log_ratio, log_ratio, value=-beta / 2
    )
    slope = torch.add(units.advantages, log_ratio, alpha=-beta)
    return _Terms(objective=objective, slope=slope, statistics=_unclipped_statistics(units))


def _gspo_objective(
    units: Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> _Terms:
    """GSPO: s_i = exp(mean_{t∈i}(lp − lp_old)), o_i = min(s_i·A_i, clip(s_i, lo, hi)·A_i)."""
    sequence_ratio = _log_ratio(units).exp_()
    return _clipped_surrogate(sequence_ratio, units, clip_low_threshold, clip_high_threshold, None)


def _cross_entropy_objective(units: Units) -> _Terms:
    """Cross entropy: o_t = w·lp with per-token weights w (passed as advantages)."""
    return _Terms(
        objective=((1.0, units.advantages, _logprobs(units)),),
        slope=units.advantages,
        statistics=_unclipped_statistics(units),
        slope_is_scratch=False,
    )


# --- the gradient ----------------------------------------------------------------------


def _loss_gradient(
    terms: _Terms, derivative: float | Tensor, tokens: Units, units: Units
) -> Tensor:
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


class _KnownGradient(torch.autograd.Function):
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


# --- the compiled single-pass path -----------------------------------------------------

FUSED_MIN_TOKENS = 1 << 18
"""Positions (256 sequences of 1024) from which ``fused=None`` runs the compiled form on CPU.

From here the compiled form is faster than the eager kernel (``benchmarks/losses.py``).
Its first call in a process compiles for a few seconds (per kernel, dtype and variant):
noise in a training run, but not worth it for the small calls of tests and notebooks.
"""

FUSED_MAX_TOKENS = 1 << 31
"""Positions from which even ``fused=True`` runs the eager kernel: the compiled forms count
clipped positions in int32 (``fused_losses._count``)."""

# Forms whose compilation failed in this process: they run eagerly from then on. A cache
# like torch's own compile cache (results never depend on it, only speed).
_UNCOMPILABLE_FORMS: set[Callable[..., FusedTerms]] = set()


@functools.cache
def _compiled_form(form: Callable[..., FusedTerms]) -> Callable[..., FusedTerms]:
    """``form`` under torch.compile, with symbolic sizes: one compilation serves every N."""
    return torch.compile(form, dynamic=True)


# The compiled forms' 0-d inputs by (value, dtype, device): the forms only read them, and
# building one takes ~5 us, ~1% of a call at 256k positions. A cache, as `_compiled_form`'s
# and `_UNCOMPILABLE_FORMS` are: results never depend on it, only speed.
_SCALARS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}
_MAX_SCALARS = 256


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a 0-d tensor, made once per (value, dtype, device); one made under a
    tensor mode (a fake or traced tensor, not a plain one) is never kept."""
    key = (value, dtype, device)
    tensor = _SCALARS.get(key)
    if tensor is None:
        tensor = torch.tensor(value, dtype=dtype, device=device)
        if type(tensor) is Tensor and len(_SCALARS) < _MAX_SCALARS:
            _SCALARS[key] = tensor
    return tensor


def _run_fused(
    form: Callable[..., FusedTerms],
    inputs: Inputs,
    logprobs: Tensor,
    reduction: str,
    norm_length: float | None,
    config: LossConfig,
) -> tuple[Tensor, dict[str, float]] | None:
    """The kernel through its compiled single-pass form; None (run eagerly) if it does not
    compile here or its sums overflowed on finite inputs."""
    values, old, advantages, selected, count, lengths, _ = inputs
    num_positions = values.numel()
    if form in _UNCOMPILABLE_FORMS or num_positions >= FUSED_MAX_TOKENS:
        return None
    if selected is None:
        # One graph for masked and unmasked batches: an all-true mask costs a byte a token.
        selected = torch.ones(num_positions, dtype=torch.bool, device=values.device)
    derivative = reduction_derivative(
        reduction,
        norm_length,
        count,
        lambda: segment_sum(as_float(selected, torch.empty_like(values)), lengths),
        lengths,
    )
    # 0-d tensors, not floats: a new threshold or batch size then needs no recompilation.
    config_tensors = {
        key: _scalar(math.inf if value is None else value, values.dtype, values.device)
        for key, value in config.items()
    }
    if isinstance(derivative, float):
        derivative = _scalar(derivative, values.dtype, values.device)
    want_gradient = logprobs.requires_grad and torch.is_grad_enabled()
    try:
        with torch.no_grad():
            terms = _compiled_form(form)(
                values,
                old,
                advantages,
                selected,
                derivative.to(values.dtype),
                want_gradient,
                **config_tensors,
            )
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
        _UNCOMPILABLE_FORMS.add(form)
        reason = (str(error).strip().splitlines() or [""])[0][:300]  # compiler logs run long
        warnings.warn(
            f"torch.compile could not build the fused {form.__name__} here "
            f"({type(error).__name__}: {reason}); using the eager kernel from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    # A non-finite input, or a sum that overflowed (math.isfinite: a 0-d tensor's
    # isfinite is five operations, ~35 us, 5% of a call at 256k positions).
    if not math.isfinite(float(terms.total)):
        error = nonfinite_error(inputs)
        if error is not None:
            raise error
        # Finite inputs: an overflow (e.g. of lp − lp_old, which makes the probe NaN). The
        # eager kernel computes such batches exactly, so the result is the eager one.
        return None
    loss = terms.total.neg()
    if want_gradient:
        assert terms.gradient is not None
        loss = _KnownGradient.apply(logprobs, loss, terms.gradient.to(logprobs.dtype))
    return loss, _metrics(loss, count, count, terms.statistics, values.device)


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
    objective: Callable[..., _Terms] = attrs.field(repr=False)
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
            result = _run_fused(form, inputs, logprobs, reduction, norm_length, resolved)
            if result is not None:
                return result
        tokens = pack_finite(inputs)
        units = tokens.per_sequence() if self.sequence_level else tokens
        terms = self.objective(units, **resolved)
        total, derivative = aggregate(terms.objective, units, reduction, norm_length)
        loss = total.neg_()
        if logprobs.requires_grad and torch.is_grad_enabled():
            gradient = _loss_gradient(terms, derivative, tokens, units)
            # Autograd would cast a float32 gradient too, but only at backward: casting now
            # holds half the memory until then and hands over the tensor without a copy.
            loss = _KnownGradient.apply(logprobs, loss, gradient.to(logprobs.dtype))
        device = logprobs.device
        return loss, _metrics(loss, units.unit_count, units.token_count, terms.statistics, device)

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


@torch.no_grad()
def _metrics(
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


importance_sampling = LossKernel(
    name="importance_sampling",
    defaults={},
    sequence_level=False,
    objective=_importance_sampling_objective,
    fused_form=fused_losses.fused_importance_sampling,
)
ppo = LossKernel(
    name="ppo",
    defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "dual_clip": None},
    sequence_level=False,
    objective=_ppo_objective,
    fused_form=fused_losses.fused_ppo,
)
cispo = LossKernel(
    name="cispo",
    defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    sequence_level=False,
    objective=_cispo_objective,
    fused_form=fused_losses.fused_cispo,
)
dro = LossKernel(
    name="dro",
    defaults={"beta": 0.05},
    sequence_level=False,
    objective=_dro_objective,
    fused_form=fused_losses.fused_dro,
    weight_scaled_keys=("beta",),
)
gspo = LossKernel(
    name="gspo",
    defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    sequence_level=True,
    objective=_gspo_objective,
    service_builtin=False,
)
cross_entropy = LossKernel(
    name="cross_entropy",
    defaults={},
    sequence_level=False,
    objective=_cross_entropy_objective,
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
