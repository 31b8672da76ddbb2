"""A token-level kernel through its single-pass form (``fused_losses``) under torch.compile.

``run_fused`` computes the loss, its gradient and the statistics in one vectorized loop;
it returns None, and the eager kernel runs, where the form does not compile here (after
one RuntimeWarning) or its sums overflowed on finite inputs. ``grpo.core.losses`` decides
when to call it (``FUSED_MIN_TOKENS``).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from grpo.core.fused_losses import FusedTerms
from grpo.core.loss_gradient import KnownGradient, loss_metrics
from grpo.core.packing import Inputs, as_float, nonfinite_error, segment_sum
from grpo.core.reductions import reduction_derivative

__all__ = ["FUSED_MAX_TOKENS", "FUSED_MIN_TOKENS", "run_fused"]

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


def run_fused(
    form: Callable[..., FusedTerms],
    inputs: Inputs,
    logprobs: Tensor,
    reduction: str,
    norm_length: float | None,
    config: Mapping[str, float | None],
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
        loss = KnownGradient.apply(logprobs, loss, terms.gradient.to(logprobs.dtype))
    return loss, loss_metrics(loss, count, count, terms.statistics, values.device)
