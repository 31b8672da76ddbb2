"""KL estimators to a reference policy (docs/FORMULAS.md, KL to a reference policy).

With ``δ = lp − lp_ref``, ``KL_ESTIMATORS``: k1 ``δ``, k2 ``δ²/2``, k3
``exp(−δ) + δ − 1``; ``kl_penalty`` gives the elementwise term. ``grpo train`` uses it as
reward shaping of the advantages (``grpo.core.advantages``), not as a loss term.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_penalty"]


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

    Used as a penalty term ``kl_coef · Σ_t m_t·k_t`` or, as ``grpo train`` does, as reward
    shaping of the advantages (docs/FORMULAS.md, KL).
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
