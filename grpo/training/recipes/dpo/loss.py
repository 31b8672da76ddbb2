"""`grpo dpo`'s loss as the callable PyTRIO's ``forward_backward_custom`` expects.

The per-datum log-probs of each pair's chosen and rejected completion are summed over their
masks into sequence log-probs, then the core DPO kernel (`grpo.core.dpo`) runs against the
reference's; the callable returns the loss times the service's divisor (the seam of
`grpo.training.custom_loss`), so the gradient applied is the loss's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from pytrio.types import Datum
from torch import Tensor

from grpo.core.dpo import DpoSettings, dpo_loss, sequence_logprobs
from grpo.core.normalization import NORMALIZATIONS
from grpo.training.custom_loss import checked_logprobs, surrogate_divisor

__all__ = ["DpoLoss", "as_dpo_loss"]


@attrs.frozen
class DpoLoss:
    """``loss_fn(datums, logprobs_list) -> (loss, metrics)`` of `grpo dpo` over P pairs.

    The datums are each pair's chosen then rejected completion, pair after pair; the loss
    sums each datum's target log-probs over its completion mask into log π(y|x), and runs
    the core kernel (`grpo.core.dpo.dpo_loss`) against the reference's sequence log-probs,
    held here as constants. Metric keys are prefixed ``dpo/``.
    """

    settings: DpoSettings
    mask: Tensor = attrs.field(repr=False)
    seq_lens: tuple[int, ...] = attrs.field(repr=False)
    ref_chosen: Tensor = attrs.field(repr=False)
    ref_rejected: Tensor = attrs.field(repr=False)
    chosen_tokens: Tensor = attrs.field(repr=False)
    service_normalization: str = attrs.field(
        default="sum", validator=attrs.validators.in_(NORMALIZATIONS)
    )

    def __call__(
        self, data: Sequence[Datum], logprobs_list: Sequence[Tensor]
    ) -> tuple[Tensor, dict[str, float]]:
        """The DPO loss times the service's divisor D (`surrogate_divisor`; 1 under ``sum``),
        so the gradient applied is the loss's own, and the ``dpo/`` metrics (unscaled)."""
        logprobs = checked_logprobs(data, logprobs_list, self.seq_lens)
        loss, metrics = self.of(logprobs)
        divisor = surrogate_divisor(self.service_normalization, data, logprobs, self.of)
        return (loss if divisor == 1.0 else loss * divisor), metrics

    def of(self, logprobs_N: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The loss and metrics of the packed target log-probs of the 2P datums (float64)."""
        sequences = sequence_logprobs(logprobs_N.to(torch.float64), self.mask, self.seq_lens)
        loss, metrics = dpo_loss(
            sequences[0::2],
            sequences[1::2],
            self.ref_chosen,
            self.ref_rejected,
            self.settings,
            chosen_tokens_P=self.chosen_tokens,
        )
        return loss, {f"dpo/{key}": value for key, value in metrics.items()}


def as_dpo_loss(
    settings: DpoSettings,
    masks_D: Sequence[np.ndarray],
    ref_chosen_P: np.ndarray,
    ref_rejected_P: np.ndarray,
    service_normalization: str = "sum",
) -> DpoLoss:
    """The DPO loss_fn of datums with target masks ``masks_D`` (chosen, rejected, pair after
    pair) and the pairs' reference sequence log-probs, pre-scaled for the divisor of the
    service it is sent to (``service_normalization``)."""
    if len(masks_D) != 2 * len(ref_chosen_P) or len(ref_chosen_P) != len(ref_rejected_P):
        raise ValueError(
            f"{len(masks_D)} datums for {len(ref_chosen_P)} pairs: expected two datums a pair"
        )
    mask = np.concatenate([np.asarray(m, dtype=bool) for m in masks_D])
    return DpoLoss(
        settings=settings,
        mask=torch.from_numpy(mask),
        seq_lens=tuple(int(np.size(m)) for m in masks_D),
        ref_chosen=torch.as_tensor(ref_chosen_P, dtype=torch.float64),
        ref_rejected=torch.as_tensor(ref_rejected_P, dtype=torch.float64),
        chosen_tokens=torch.tensor([int(np.sum(m)) for m in masks_D[0::2]], dtype=torch.float64),
        service_normalization=service_normalization,
    )
