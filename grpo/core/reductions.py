"""How a kernel's per-unit objective aggregates into its loss (docs/FORMULAS.md, Aggregation).

Reductions (``REDUCTIONS``), with ``ℓ_t = −o_t·m_t``, ``n_i`` the masked-in token count of
sequence ``i`` and ``B`` the number of sequences with ``n_i > 0``: ``sum`` ``Σ_t ℓ_t``
(default), ``token_mean`` ``Σ_t ℓ_t / Σ_t m_t``, ``seq_mean_token_mean``
``(1/B) Σ_i Σ_{t∈i} ℓ_t / n_i``, ``seq_mean_token_sum`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t``,
``seq_mean_token_sum_norm`` ``(1/B) Σ_i Σ_{t∈i} ℓ_t / L`` (``norm_length`` = L).
A sequence-level kernel treats each sequence as one unit carrying its loss ``ℓ_i``
(the token sum becomes ``ℓ_i`` and every ``n_i`` becomes 1): ``sum`` is ``Σ_i ℓ_i``,
``token_mean`` and both ``seq_mean_token_*`` are ``(1/B) Σ_i ℓ_i``, and
``seq_mean_token_sum_norm`` is ``(1/B) Σ_i ℓ_i / L``.

Every reduction is linear in the objective: aggregate = Σ_u d_u·o_u, with ``d`` the
reduction's derivative (``reduction_derivative``), which the kernels also use for the
gradient. ``validate_reduction`` checks a reduction name and its ``norm_length``;
``aggregate`` gives the aggregate and ``d`` together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor

if TYPE_CHECKING:
    from grpo.core.packing import Units

__all__ = ["REDUCTIONS", "Products", "aggregate", "reduction_derivative", "validate_reduction"]

REDUCTIONS: tuple[str, ...] = (
    "sum",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


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


Products: TypeAlias = tuple[tuple[float, Tensor, Tensor], ...]
"""An objective as scaled products ((c_k, a_k, b_k), ...): o = Σ_k c_k·a_k·b_k per unit."""


def _objective_values(objective: Tensor | Products) -> Tensor:
    """o per unit."""
    if isinstance(objective, Tensor):
        return objective
    values = torch.zeros_like(objective[0][1])
    for scale, first, second in objective:
        values.addcmul_(first, second, value=scale)
    return values


def _objective_sum(objective: Tensor | Products) -> Tensor:
    """Σ_u o_u."""
    if isinstance(objective, Tensor):
        return objective.sum()
    totals = [torch.dot(first, second) * scale for scale, first, second in objective]
    return torch.stack(totals).sum()


def reduction_derivative(
    reduction: str,
    norm_length: float | None,
    unit_count: int,
    units_per_sequence: Callable[[], Tensor],
    seq_lens: Tensor,
) -> float | Tensor:
    """d(aggregate)/d o_u under ``reduction``: aggregate = Σ_u d_u·o_u (docs/FORMULAS.md).

    One number, or one per unit for ``seq_mean_token_mean`` (1/(B·n_i) on sequence i).
    ``units_per_sequence`` gives n_i as floats; it is only called by the ``seq_mean_*``
    reductions.
    """
    if reduction == "sum":
        return 1.0
    if reduction == "token_mean":
        return 1.0 / max(unit_count, 1)
    counts = units_per_sequence()
    num_sequences = max(int(counts.count_nonzero()), 1)
    if reduction == "seq_mean_token_mean":
        inverse_counts = counts.clamp(min=1).reciprocal_().div_(num_sequences)
        return torch.repeat_interleave(inverse_counts, seq_lens, output_size=int(seq_lens.sum()))
    if reduction == "seq_mean_token_sum":
        return 1.0 / num_sequences
    assert norm_length is not None  # validate_reduction guarantees it for this reduction
    return 1.0 / num_sequences / norm_length


def aggregate(
    objective: Tensor | Products, units: Units, reduction: str, norm_length: float | None
) -> tuple[Tensor, float | Tensor]:
    """(Σ_u d_u·o_u, the derivative d): the aggregate under ``reduction``, 0 if none selected."""
    derivative = reduction_derivative(
        reduction, norm_length, units.unit_count, units.counts_per_sequence, units.seq_lens
    )
    if isinstance(derivative, float):
        return _objective_sum(objective) * derivative, derivative
    return torch.dot(_objective_values(objective), derivative), derivative
