"""Service normalization: the conventions a trainer may divide a loss's gradient by, and the
totals of a logical batch it divides by (docs/FORMULAS.md, "Service normalization").

One definition for the local trainer (``grpo/backends/local/loss_execution.py``), the
probe's decision (``grpo/core/normalization_probe.py``), ``grpo serve`` and the
``--service-normalization`` flag. Pure: no I/O, no torch.
"""

from __future__ import annotations

import attrs

__all__ = ["NORMALIZATIONS", "BatchTotals"]

NORMALIZATIONS = ("sum", "active_tokens", "advantage_tokens", "samples")
"""The conventions: the loss as it is (``sum``), or divided by the logical batch's active
tokens, advantage tokens or samples (pytrio's ``gradient_accumulation``)."""


@attrs.frozen
class BatchTotals:
    """A logical batch's totals as pytrio's planner counts them (and sends them with every
    micro-batch, ``gradient_accumulation``): samples S, active tokens T, active tokens with a
    non-zero advantage T_A."""

    samples: int
    active_tokens: int
    advantage_tokens: int

    def denominator(self, normalization: str) -> float:
        """The D that `normalization` divides this batch's summed loss by (1 for ``sum`` and
        for a total of 0, as the local backend does)."""
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"unknown service normalization {normalization!r}; one of "
                f"{', '.join(NORMALIZATIONS)}"
            )
        if normalization == "sum":
            return 1.0
        total = {
            "active_tokens": self.active_tokens,
            "advantage_tokens": self.advantage_tokens,
            "samples": self.samples,
        }[normalization]
        return float(total) if total > 0 else 1.0

    def gradient_scale(self, normalization: str) -> float:
        """1 / the `normalization`'s total (1 for ``sum``, and for an empty total)."""
        return 1.0 / self.denominator(normalization)
