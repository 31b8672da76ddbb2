"""Wall-clock timings of the training shell, as metrics (the ``time/*`` keys of a row)."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager


@contextmanager
def timed(key: str, metrics: MutableMapping[str, float]) -> Iterator[None]:
    """``metrics[key]`` = the seconds the block took (``time.perf_counter``), set when it ends.

    Nothing is recorded when the block raises: a failed step logs no row.
    """
    start = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - start
