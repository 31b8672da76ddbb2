"""Checks of the 1-D arrays the core's records and formulas take, with errors that name them.

- `as_1d`: the value as an array, refused unless it is 1-D.
- `require_kind`: refused unless its dtype is of the given kinds (``"iu"``, ``"iuf"``, ``"b"``).
- `require_finite`: refused at its first NaN or ±inf, naming the index and the value.
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_1d", "require_finite", "require_kind"]


def as_1d(value: object, name: str, *, of: str = "", fix: str = "") -> np.ndarray:
    """``value`` as an array; ValueError naming ``name`` and the shape unless it is 1-D.

    ``of`` says what the array holds (" of rewards"), ``fix`` how to mend it ("; pass ...").
    """
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array{of}, got shape {array.shape}{fix}")
    return array


def require_kind(array: np.ndarray, name: str, kinds: str, holds: str, fix: str = "") -> None:
    """TypeError naming ``name``, the dtype and the first values unless a non-empty array's
    dtype kind is one of ``kinds`` (an empty list arrives as float64: the caller's length
    checks report that case better)."""
    if array.size and array.dtype.kind not in kinds:
        raise TypeError(
            f"{name} must hold {holds}, got dtype {array.dtype} "
            f"(first values {array[:4].tolist()}){fix}"
        )


def require_finite(array: np.ndarray, name: str, advice: str) -> None:
    """ValueError ``name[i] = value is not finite; advice`` at the first NaN or ±inf."""
    non_finite = np.flatnonzero(~np.isfinite(array))
    if non_finite.size:
        first = int(non_finite[0])
        raise ValueError(f"{name}[{first}] = {array[first].item()!r} is not finite; {advice}")
