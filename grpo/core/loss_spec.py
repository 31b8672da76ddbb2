"""A fully resolved loss: kernel, config, reduction and norm length, validated once.

The loop, ``as_custom_loss`` and the local backend all carry a ``LossSpec`` instead of a
name plus loose dicts, and convert to and from PyTRIO's ``loss_fn_config`` here only:
the wire form is the kernel's non-None config keys, plus ``reduction`` and
``norm_length`` when the reduction is not ``sum`` (PyTRIO's built-in losses only sum;
docs/FORMULAS.md, "Aggregation").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
from torch import Tensor

from grpo.core.losses import LossKernel, get_loss
from grpo.core.reductions import validate_reduction

if TYPE_CHECKING:
    from grpo.core.packing import SeqLens

__all__ = ["LossSpec"]


def _frozen_config(config: Mapping[str, float | None]) -> Mapping[str, float | None]:
    return MappingProxyType(dict(config))


@attrs.frozen
class LossSpec:
    """A validated loss: ``kernel`` with its resolved ``config``, ``reduction``, ``norm_length``.

    Build it with ``LossSpec.build`` (validates the kernel name, its config keys and
    thresholds, and the reduction) or ``LossSpec.from_loss_fn_config`` (PyTRIO's wire form).
    """

    kernel: LossKernel
    config: Mapping[str, float | None] = attrs.field(converter=_frozen_config)
    reduction: str = "sum"
    norm_length: float | None = None

    @classmethod
    def build(
        cls,
        loss: str | LossKernel,
        config: Mapping[str, object] | None = None,
        *,
        reduction: str = "sum",
        norm_length: float | None = None,
    ) -> LossSpec:
        """Kernel ``loss`` with ``config`` merged over its defaults; ValueError if invalid."""
        kernel = loss if isinstance(loss, LossKernel) else get_loss(loss)
        resolved = kernel.resolve(dict(config or {}))
        validate_reduction(reduction, norm_length)
        return cls(
            kernel=kernel,
            config=resolved,
            reduction=reduction,
            norm_length=None if norm_length is None else float(norm_length),
        )

    @classmethod
    def from_loss_fn_config(
        cls, loss_fn: str, loss_fn_config: Mapping[str, object] | None
    ) -> LossSpec:
        """The spec a ``forward_backward(loss_fn=..., loss_fn_config=...)`` request describes."""
        options = dict(loss_fn_config or {})
        reduction = options.pop("reduction", "sum")
        norm_length = options.pop("norm_length", None)
        if not isinstance(reduction, str):
            raise ValueError(f"reduction must be a string, got {reduction!r}")
        return cls.build(
            loss_fn.strip().lower(),
            options,
            reduction=reduction,
            norm_length=norm_length,  # type: ignore[arg-type]
        )

    @property
    def name(self) -> str:
        """The kernel's registry name, also the prefix of its metrics."""
        return self.kernel.name

    @property
    def service_builtin(self) -> bool:
        """Whether PyTRIO's built-in ``forward_backward`` computes this loss (kernel and sum)."""
        return self.kernel.service_builtin and self.reduction == "sum"

    def scaled(self, factor: float) -> LossSpec:
        """The spec whose loss on weights factor·w is factor × this spec's loss on w (factor
        finite and > 0): its kernel's ``weight_scaled_keys`` (DRO's β) times factor."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a weight scale must be finite and > 0, got {factor!r}")
        config = dict(self.config)
        for key in self.kernel.weight_scaled_keys:
            if config.get(key) is not None:
                config[key] = float(config[key]) * factor
        return attrs.evolve(self, config=config)

    def to_loss_fn_config(self) -> dict[str, Any]:
        """PyTRIO's ``loss_fn_config``: non-None kernel keys, then the reduction if not sum."""
        wire: dict[str, Any] = {
            key: value for key, value in self.config.items() if value is not None
        }
        if self.reduction != "sum":
            wire["reduction"] = self.reduction
            if self.norm_length is not None:
                wire["norm_length"] = self.norm_length
        return wire

    def __call__(
        self,
        logprobs: Tensor,
        sampling_logprobs: Tensor | None,
        advantages: Tensor,
        *,
        mask: Tensor | None = None,
        seq_lens: SeqLens | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """The kernel's ``(loss, metrics)`` under this spec's config and reduction."""
        return self.kernel(
            logprobs,
            sampling_logprobs,
            advantages,
            mask=mask,
            seq_lens=seq_lens,
            reduction=self.reduction,
            norm_length=self.norm_length,
            **self.config,
        )
