"""Service normalization: the conventions a trainer may divide a loss's gradient by, and the
totals of a logical batch it divides by (docs/FORMULAS.md, "Service normalization").

One definition for the local trainer (``grpo/backends/local/loss_execution.py``), the
probe's decision (``grpo/core/normalization_probe.py``), ``grpo serve`` and the
``--service-normalization`` flag. Pure: no I/O, no torch.
"""

from __future__ import annotations

import attrs

__all__ = [
    "DEFAULT_SERVICE_NORMALIZATION",
    "LOCAL_TRAIN_NORMALIZATION",
    "NORMALIZATIONS",
    "BatchTotals",
    "ServiceDivisor",
    "service_divisor",
]

NORMALIZATIONS = ("sum", "active_tokens", "advantage_tokens", "samples")
"""The conventions: the loss as it is (``sum``), or divided by the logical batch's active
tokens, advantage tokens or samples (pytrio's ``gradient_accumulation``)."""

DEFAULT_SERVICE_NORMALIZATION = "samples"
"""What the real service is taken to divide by, per logical request (docs/FORMULAS.md,
"Service normalization": the evidence and its sources); the local backend's and
``grpo serve``'s default."""

LOCAL_TRAIN_NORMALIZATION = "sum"
"""What ``grpo train``/``grpo sft`` ask their embedded local backend for when no
``--service-normalization`` is given: the loop pre-scales the datums for any divisor, so the
choice changes only float rounding, and under ``sum`` the pre-scaling is the identity."""


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


@attrs.frozen
class ServiceDivisor:
    """The convention a loop pre-scales its datums for, and where it was learned: ``local``
    (the embedded backend, as it reports itself, else as the run asked it), ``flag``
    (--service-normalization), ``probe`` (the normalization probe's verdict), ``tinker``
    (Tinker's documented sum) or ``default``
    (`DEFAULT_SERVICE_NORMALIZATION`: a service not measured)."""

    convention: str
    source: str


def service_divisor(
    backend: str, flag: str | None, probed: str | None, reported: str | None = None
) -> ServiceDivisor:
    """The divisor a run's service applies. Local backend: what it `reported`, else the
    flag, else `LOCAL_TRAIN_NORMALIZATION` (what the run asks it for). Tinker: the flag, else
    ``sum`` (its documented convention, source ``tinker``). PyTRIO: the flag
    when given, else the probe's verdict, else `DEFAULT_SERVICE_NORMALIZATION`."""
    named = (("--service-normalization", flag), ("the probe's verdict", probed))
    for name, value in (*named, ("the local backend", reported)):
        if value is not None and value not in NORMALIZATIONS:
            raise ValueError(f"{name} {value!r} is not one of {', '.join(NORMALIZATIONS)}")
    if backend == "local":
        return ServiceDivisor(reported or flag or LOCAL_TRAIN_NORMALIZATION, "local")
    if backend == "tinker":
        return ServiceDivisor(flag, "flag") if flag else ServiceDivisor("sum", "tinker")
    if flag is not None:
        return ServiceDivisor(flag, "flag")
    if probed is not None:
        return ServiceDivisor(probed, "probe")
    return ServiceDivisor(DEFAULT_SERVICE_NORMALIZATION, "default")
