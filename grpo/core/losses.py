"""Vectorized policy-gradient loss kernels over a packed token batch (FORMULAS.md).

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

Reductions (``REDUCTIONS``), with ``ℓ_t = −o_t·m_t``, ``n_i`` the masked-in token count of
sequence ``i`` and ``B`` the number of sequences with ``n_i > 0``: ``sum`` ``Σ_t ℓ_t``
(default), ``token_mean`` ``Σ_t ℓ_t / Σ_t m_t``, ``seq_mean_token_mean``
``(1/B) Σ_i Σ_{t∈i} ℓ_t / n_i``, ``seq_mean_token_sum`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t``,
``seq_mean_token_sum_norm`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t / L`` (``norm_length`` = L).
A sequence-level kernel treats each sequence as one unit carrying its loss ``ℓ_i``
(the token sum becomes ``ℓ_i`` and every ``n_i`` becomes 1): ``sum`` is ``Σ_i ℓ_i``,
``token_mean`` and both ``seq_mean_token_*`` are ``(1/B) Σ_i ℓ_i``, and
``seq_mean_token_sum_norm`` is ``(1/B) Σ_i ℓ_i / L``.

Masked positions contribute nothing to the loss or the gradient for any finite inputs:
the log-ratio and the advantage are replaced by 0 there *before* ``exp``, so an
overflowing ratio on a prompt position cannot turn into NaN. An empty selection gives
loss 0 with a zero gradient.

Metrics are over masked-in tokens (over sequences with ``n_i > 0`` for ``gspo``):
``loss``, ``train_tokens``, ``ratio_mean``/``ratio_min``/``ratio_max`` (0.0 when nothing
is selected), ``clip_fraction`` (share whose gradient the clip removed or reweighted),
``clip_low_fraction`` (r < lo), ``clip_high_fraction`` (r > hi); ``cispo`` adds
``clipped_ratio_mean``. ``cross_entropy`` without sampling log-probs reports only
``loss`` and ``train_tokens``.

KL to a reference policy (``δ = lp − lp_ref``): ``KL_ESTIMATORS`` k1 ``δ``, k2 ``δ²/2``,
k3 ``exp(−δ) + δ − 1``; ``kl_penalty`` gives the elementwise term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeAlias

import attrs
import torch
from torch import Tensor

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    SeqLens: TypeAlias = Tensor | Sequence[int] | ArrayLike

__all__ = [
    "KL_ESTIMATORS",
    "LOSSES",
    "REDUCTIONS",
    "LossKernel",
    "cispo",
    "cross_entropy",
    "dro",
    "get_loss",
    "gspo",
    "importance_sampling",
    "kl_penalty",
    "ppo",
    "resolve_config",
    "validate_reduction",
]

REDUCTIONS: tuple[str, ...] = (
    "sum",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

LossConfig: TypeAlias = dict[str, float | None]


def validate_reduction(reduction: str, norm_length: float | None) -> None:
    """Raise ValueError unless ``reduction`` is in REDUCTIONS and ``norm_length`` fits it."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    if reduction == "seq_mean_token_sum_norm":
        if norm_length is None:
            raise ValueError(
                "reduction 'seq_mean_token_sum_norm' needs norm_length (the constant L, "
                "e.g. the maximum completion length); pass norm_length=..."
            )
        if isinstance(norm_length, bool) or not isinstance(norm_length, (int, float)):
            raise ValueError(f"norm_length must be a number, got {norm_length!r}")
        if not (math.isfinite(norm_length) and norm_length > 0):
            raise ValueError(f"norm_length must be a finite number > 0, got {norm_length!r}")
    elif norm_length is not None:
        raise ValueError(
            f"norm_length={norm_length!r} is only used by reduction "
            f"'seq_mean_token_sum_norm', not {reduction!r}; drop it or change the reduction"
        )


# --- packed inputs ---------------------------------------------------------------------


@attrs.frozen
class _Units:
    """Validated kernel inputs, one entry per unit (a token, or a sequence for GSPO).

    ``log_ratio`` and ``advantages`` are already 0 on masked-out units, so any
    elementwise objective built from them is exactly 0 there with a zero gradient.
    """

    logprobs: Tensor | None
    log_ratio: Tensor | None
    advantages: Tensor
    mask: Tensor | None  # bool, None = every unit trains
    seq_lens: Tensor  # int64 units per sequence, on the data's device
    unit_count: Tensor  # 0-d int64: number of masked-in units
    token_count: Tensor  # 0-d int64: number of masked-in tokens

    def counts_per_sequence(self) -> Tensor:
        """n_i: masked-in units of each sequence, in the data's float dtype."""
        if self.mask is None:
            return self.seq_lens.to(self.advantages.dtype)
        return _segment_sum(self.mask.to(self.advantages.dtype), self.seq_lens)

    def per_sequence(self) -> _Units:
        """One unit per sequence: masked mean log-ratio and masked mean advantage A_i."""
        log_ratio = _log_ratio(self)
        tokens_per_sequence = self.counts_per_sequence()
        denominator = tokens_per_sequence.clamp(min=1)
        has_tokens = tokens_per_sequence > 0
        return _Units(
            logprobs=None,
            log_ratio=_segment_sum(log_ratio, self.seq_lens) / denominator,
            advantages=_segment_sum(self.advantages, self.seq_lens) / denominator,
            mask=has_tokens,
            seq_lens=torch.ones_like(self.seq_lens),
            unit_count=has_tokens.count_nonzero(),
            token_count=self.token_count,
        )


def _segment_sum(values_N: Tensor, seq_lens_B: Tensor) -> Tensor:
    """Σ of values over each consecutive segment (differentiable, no Python loop)."""
    return torch.segment_reduce(values_N, "sum", lengths=seq_lens_B)


def _as_seq_lens(seq_lens: SeqLens | None, num_tokens: int, device: torch.device) -> Tensor:
    if seq_lens is None:
        return torch.tensor([num_tokens], dtype=torch.int64, device=device)
    lengths = torch.as_tensor(seq_lens)
    if lengths.numel() == 0:
        # No sequences at all is one empty sequence: both select nothing.
        lengths = torch.zeros(1, dtype=torch.int64)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"seq_lens must hold integers, got dtype {lengths.dtype}")
    if lengths.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D, got shape {tuple(lengths.shape)}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    if bool((lengths < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lengths.min().item()}")
    total = int(lengths.sum())
    if total != num_tokens:
        raise ValueError(
            f"seq_lens sums to {total} but logprobs has {num_tokens} entries; "
            "seq_lens must list the lengths of the packed sequences"
        )
    return lengths.to(device)


def _as_like(name: str, values: Tensor, logprobs: Tensor) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.shape != logprobs.shape:
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}; both must be flat over the same positions"
        )
    return values.to(device=logprobs.device, dtype=logprobs.dtype)


def _pack(
    logprobs: Tensor,
    sampling_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None,
    seq_lens: SeqLens | None,
) -> _Units:
    if not isinstance(logprobs, Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    if logprobs.ndim != 1:
        raise ValueError(
            f"logprobs must be 1-D (flat packed batch), got shape {tuple(logprobs.shape)}"
        )
    if not logprobs.dtype.is_floating_point:
        raise ValueError(f"logprobs must be a floating tensor, got dtype {logprobs.dtype}")
    advantages = _as_like("advantages", advantages, logprobs)
    bool_mask: Tensor | None = None
    if mask is not None:
        mask_tensor = torch.as_tensor(mask, device=logprobs.device)
        if mask_tensor.shape != logprobs.shape:
            raise ValueError(
                f"mask has shape {tuple(mask_tensor.shape)} but logprobs has shape "
                f"{tuple(logprobs.shape)}"
            )
        bool_mask = mask_tensor if mask_tensor.dtype == torch.bool else mask_tensor != 0
        advantages = torch.where(bool_mask, advantages, 0.0)
    log_ratio: Tensor | None = None
    if sampling_logprobs is not None:
        log_ratio = logprobs - _as_like("sampling_logprobs", sampling_logprobs, logprobs)
        if bool_mask is not None:
            # Before exp: r on a masked position may overflow to inf, and inf·0 is NaN.
            log_ratio = torch.where(bool_mask, log_ratio, 0.0)
    token_count = (
        bool_mask.count_nonzero()
        if bool_mask is not None
        else torch.tensor(logprobs.numel(), device=logprobs.device)
    )
    return _Units(
        logprobs=logprobs,
        log_ratio=log_ratio,
        advantages=advantages,
        mask=bool_mask,
        seq_lens=_as_seq_lens(seq_lens, logprobs.numel(), logprobs.device),
        unit_count=token_count,
        token_count=token_count,
    )


# --- per-token objectives --------------------------------------------------------------
# Each returns (objective o per unit, ratio r per unit or None); o is 0 on masked units.


def _log_ratio(units: _Units) -> Tensor:
    # LossKernel.__call__ rejects a missing lp_old for every kernel that reads this.
    assert units.log_ratio is not None
    return units.log_ratio


def _logprobs(units: _Units) -> Tensor:
    # Only sequence-level units drop lp, and the sequence-level objective never reads it.
    assert units.logprobs is not None
    return units.logprobs


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, low: float, high: float, dual_clip: float | None
) -> Tensor:
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    if dual_clip is None:
        return objective
    return torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)


def _importance_sampling_objective(units: _Units) -> tuple[Tensor, Tensor | None]:
    """Importance sampling: o_t = r·A, gradient d(−o_t)/d lp = −r·A."""
    ratio = torch.exp(_log_ratio(units))
    return ratio * units.advantages, ratio


def _ppo_objective(
    units: _Units,
    *,
    clip_low_threshold: float,
    clip_high_threshold: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor | None]:
    """PPO: o_t = min(r·A, clip(r, lo, hi)·A); dual clip c: max(o_t, c·A) where A < 0."""
    ratio = torch.exp(_log_ratio(units))
    objective = _clipped_surrogate(
        ratio, units.advantages, clip_low_threshold, clip_high_threshold, dual_clip
    )
    return objective, ratio


def _cispo_objective(
    units: _Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> tuple[Tensor, Tensor | None]:
    """CISPO: o_t = sg(clip(r, lo, hi))·lp·A, gradient −clip(r, lo, hi)·A everywhere."""
    ratio = torch.exp(_log_ratio(units).detach())
    weight = ratio.clamp(clip_low_threshold, clip_high_threshold) * units.advantages
    return weight * _logprobs(units), ratio


def _dro_objective(units: _Units, *, beta: float) -> tuple[Tensor, Tensor | None]:
    """DRO: o_t = lp·A − (β/2)·(lp − lp_old)², gradient −A + β·(lp − lp_old)."""
    log_ratio = _log_ratio(units)
    return _logprobs(units) * units.advantages - (beta / 2) * log_ratio.square(), None


def _gspo_objective(
    units: _Units, *, clip_low_threshold: float, clip_high_threshold: float
) -> tuple[Tensor, Tensor | None]:
    """GSPO: s_i = exp(mean_{t∈i} (lp − lp_old)), o_i = min(s_i·A_i, clip(s_i, lo, hi)·A_i)."""
    sequence_ratio = torch.exp(_log_ratio(units))
    objective = _clipped_surrogate(
        sequence_ratio, units.advantages, clip_low_threshold, clip_high_threshold, None
    )
    return objective, sequence_ratio


def _cross_entropy_objective(units: _Units) -> tuple[Tensor, Tensor | None]:
    """Cross entropy: o_t = w·lp with per-token weights w (passed as advantages)."""
    return units.advantages * _logprobs(units), None


# --- clip statistics (metrics) ---------------------------------------------------------
# Each returns counts (or sums) over the selected units as 0-d tensors; the metrics divide
# them by the number of selected units. ``scratch`` is a buffer shaped like ``ratio`` that
# they may overwrite. Counting uses count_nonzero: summing a bool tensor
# first converts it to int64, several times slower at millions of tokens.


def _no_clip_sums(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    config: Mapping[str, float | None],
    scratch: Tensor,
) -> dict[str, Tensor]:
    zero = ratio.new_zeros((), dtype=torch.int64)
    return {"clip_fraction": zero, "clip_low_fraction": zero, "clip_high_fraction": zero}


def _outside_bounds(
    ratio: Tensor, mask: Tensor | None, low: float, high: float
) -> tuple[Tensor, Tensor]:
    below, above = ratio < low, ratio > high
    if mask is not None:
        below &= mask
        above &= mask
    return below, above


def _pessimistic_clip_sums(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    config: Mapping[str, float | None],
    scratch: Tensor,
) -> dict[str, Tensor]:
    """Zero-gradient units: r > hi with A > 0; r < lo, or r > c under dual clip, with A < 0."""
    below, above = _outside_bounds(
        ratio, mask, config["clip_low_threshold"], config["clip_high_threshold"]
    )
    negative_clipped = below
    dual_clip = config.get("dual_clip")
    if dual_clip is not None:
        negative_clipped = negative_clipped | (ratio > dual_clip)
    # Masked units hold A = 0, so the advantage tests exclude them without the mask.
    clipped = ((advantages > 0) & above) | ((advantages < 0) & negative_clipped)
    return {
        "clip_fraction": clipped.count_nonzero(),
        "clip_low_fraction": below.count_nonzero(),
        "clip_high_fraction": above.count_nonzero(),
    }


def _reweight_clip_sums(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    config: Mapping[str, float | None],
    scratch: Tensor,
) -> dict[str, Tensor]:
    """Every ratio outside [lo, hi] has its gradient weight replaced by the bound."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    below, above = _outside_bounds(ratio, mask, low, high)
    clipped_ratio = torch.clamp(ratio, low, high, out=scratch)
    if mask is not None:
        clipped_ratio = torch.where(mask, clipped_ratio, ratio.new_zeros(()), out=scratch)
    return {
        "clip_fraction": (below | above).count_nonzero(),
        "clip_low_fraction": below.count_nonzero(),
        "clip_high_fraction": above.count_nonzero(),
        "clipped_ratio_mean": clipped_ratio.sum(),
    }


# --- the registry ----------------------------------------------------------------------


def _freeze_defaults(defaults: Mapping[str, float | None]) -> Mapping[str, float | None]:
    return MappingProxyType(dict(defaults))


@attrs.frozen(slots=False)
class LossKernel:
    """A named loss: config defaults, its objective, and the clip statistics it reports.

    Calling it runs the whole kernel:
    ``loss, metrics = kernel(logprobs, sampling_logprobs, advantages, *, mask=None,
    seq_lens=None, reduction="sum", norm_length=None, **config)``.
    """

    name: str
    defaults: Mapping[str, float | None] = attrs.field(converter=_freeze_defaults)
    sequence_level: bool
    objective: Callable[..., tuple[Tensor, Tensor | None]] = attrs.field(repr=False)
    clip_sums: Callable[
        [Tensor, Tensor, Tensor | None, Mapping[str, float | None], Tensor], dict[str, Tensor]
    ] = attrs.field(repr=False)
    weight_input: str = "advantages"
    """The datum ``loss_fn_inputs`` key holding the per-token weight (A, or w for CE)."""
    needs_sampling_logprobs: bool = True
    """Whether the objective uses lp_old (cross_entropy only reports ratios when given it)."""

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
        **config: float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss −aggregate(o) under ``reduction`` and float metrics over masked-in units."""
        resolved = self.resolve(config)
        validate_reduction(reduction, norm_length)
        if sampling_logprobs is None and self.needs_sampling_logprobs:
            raise ValueError(
                f"loss {self.name!r} needs sampling_logprobs (the sampler's log-probs), got None"
            )
        units = _pack(logprobs, sampling_logprobs, advantages, mask, seq_lens)
        if self.sequence_level:
            units = units.per_sequence()
        objective, ratio = self.objective(units, **resolved)
        loss = -_aggregate(objective, units, reduction, norm_length)
        return loss, _metrics(self, loss, units, ratio, resolved)


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


def _aggregate(
    objective: Tensor, units: _Units, reduction: str, norm_length: float | None
) -> Tensor:
    """Σ of the objective under ``reduction`` (FORMULAS.md, Aggregation); 0 when empty."""
    if reduction == "sum":
        return objective.sum()
    if reduction == "token_mean":
        return objective.sum() / units.unit_count.clamp(min=1)
    units_per_sequence = units.counts_per_sequence()
    num_sequences = units_per_sequence.count_nonzero().clamp(min=1)
    if reduction == "seq_mean_token_mean":
        per_sequence = _segment_sum(objective, units.seq_lens) / units_per_sequence.clamp(min=1)
        return per_sequence.sum() / num_sequences
    if reduction == "seq_mean_token_sum":
        return objective.sum() / num_sequences
    assert norm_length is not None  # validate_reduction guarantees it for this reduction
    return objective.sum() / num_sequences / norm_length


@torch.no_grad()
def _metrics(
    kernel: LossKernel,
    loss: Tensor,
    units: _Units,
    ratio: Tensor | None,
    config: Mapping[str, float | None],
) -> dict[str, float]:
    """Loss, token count, ratio statistics and clip shares over the selected units."""
    names = ["loss", "train_tokens"]
    values = [loss.detach(), units.token_count]
    if units.log_ratio is not None:
        ratio = torch.exp(units.log_ratio) if ratio is None else ratio.detach()
        count = units.unit_count
        per_unit = count.clamp(min=1).to(torch.float64)
        # Every statistic below reuses one scratch buffer: at millions of tokens a fresh
        # buffer per statistic costs page faults comparable to the arithmetic itself.
        scratch = torch.empty_like(ratio)
        if ratio.numel() == 0:
            ratio_sum = ratio_min = ratio_max = ratio.new_zeros(())
        elif units.mask is None:
            ratio_sum = ratio.sum()
            ratio_min, ratio_max = torch.aminmax(ratio)
        else:
            # r >= 0, so a masked unit set to 0 changes neither the sum nor the maximum.
            selected = torch.where(units.mask, ratio, ratio.new_zeros(()), out=scratch)
            ratio_sum, ratio_max = selected.sum(), selected.max()
            selected = torch.where(units.mask, ratio, ratio.new_full((), math.inf), out=scratch)
            ratio_min = selected.min().where(count > 0, 0.0)
        names += ["ratio_mean", "ratio_min", "ratio_max"]
        values += [ratio_sum.to(torch.float64) / per_unit, ratio_min, ratio_max]
        sums = kernel.clip_sums(ratio, units.advantages, units.mask, config, scratch)
        names += list(sums)
        values += [total.to(torch.float64) / per_unit for total in sums.values()]
    # One transfer for all metrics: a device sync per metric would cost more than the loss.
    stacked = torch.stack([value.to(torch.float64) for value in values]).tolist()
    return dict(zip(names, stacked, strict=True))


importance_sampling = LossKernel(
    name="importance_sampling",
    defaults={},
    sequence_level=False,
    objective=_importance_sampling_objective,
    clip_sums=_no_clip_sums,
)
ppo = LossKernel(
    name="ppo",
    defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "dual_clip": None},
    sequence_level=False,
    objective=_ppo_objective,
    clip_sums=_pessimistic_clip_sums,
)
cispo = LossKernel(
    name="cispo",
    defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    sequence_level=False,
    objective=_cispo_objective,
    clip_sums=_reweight_clip_sums,
)
dro = LossKernel(
    name="dro",
    defaults={"beta": 0.05},
    sequence_level=False,
    objective=_dro_objective,
    clip_sums=_no_clip_sums,
)
gspo = LossKernel(
    name="gspo",
    defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    sequence_level=True,
    objective=_gspo_objective,
    clip_sums=_pessimistic_clip_sums,
)
cross_entropy = LossKernel(
    name="cross_entropy",
    defaults={},
    sequence_level=False,
    objective=_cross_entropy_objective,
    clip_sums=_no_clip_sums,
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


# --- KL to a reference policy ------------------------------------------------------------


def _kl_k1(delta: Tensor) -> Tensor:
    """k1 = δ (unbiased, high variance, can be negative)."""
    return delta


def _kl_k2(delta: Tensor) -> Tensor:
    """k2 = δ²/2."""
    return delta.square() / 2


def _kl_k3(delta: Tensor) -> Tensor:
    """k3 = exp(−δ) + δ − 1 (≥ 0, low variance); expm1 keeps it exact near δ = 0."""
    return torch.expm1(-delta) + delta


KL_ESTIMATORS: Mapping[str, Callable[[Tensor], Tensor]] = MappingProxyType(
    {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}
)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str = "k3") -> Tensor:
    """Elementwise KL estimate k(δ) with δ = lp − lp_ref.

    Used as a penalty term: add ``kl_coef · Σ_t m_t·k_t`` to the loss (FORMULAS.md, KL).
    """
    try:
        estimate = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}"
        ) from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}"
        )
    return estimate(logprobs - ref_logprobs)
