"""LaTeX answers graded by math-verify, in a process pool with a per-call timeout.

- `math_gold`: a row's gold answer: the last `\\boxed{}` of a MATH-style `solution` column,
  else the answer `--gold-rule` extracted (`RewardInput.gold`).
- `verify_answer`: math-verify's parse of both answers (each wrapped in `\\boxed{}`), then
  its `verify(gold, answer)`: 1.0 when equivalent (`\\frac{1}{2}` = `0.5`, `2\\sqrt{2}` =
  `\\sqrt{8}`, `x=5` = `5`, intervals, tuples, sets), else 0.0. In-process, no timeout.
- `verify_pooled`: `verify_answer` in a worker process, 0.0 when it runs past the timeout.
- `run_pooled`: any picklable call in that pool, `GradingTimeout` past the timeout.

math-verify's own timeout uses `signal.alarm`, which raises ValueError off the main thread
(`--reward-workers` calls rewards from threads), so it is disabled here and ours is used:
calls go to a module-level `ProcessPoolExecutor` (forkserver, else spawn; created on first
use with every worker started and math-verify imported before any call is timed), and a
call still running after `timeout_s` counts 0 and recycles the pool (its workers are
killed; calls of other threads in flight on it are resubmitted to the new pool). The
grading is a pure function of the two strings, so pooled results equal serial ones.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from grpo.core.rewards import extract_boxed

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GradingTimeout",
    "math_gold",
    "run_pooled",
    "verify_answer",
    "verify_pooled",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
POOL_WORKERS = max(1, min(4, os.cpu_count() or 1))
_WARM_UP_TIMEOUT_S = 300.0

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()
_running = threading.BoundedSemaphore(POOL_WORKERS)  # calls in the pool at once: none queued
_ATTEMPTS = 5


class GradingTimeout(TimeoutError):
    """A pooled call that ran past its timeout (its pool was recycled)."""


def math_gold(row: Mapping[str, Any], gold: str) -> str:
    """The last `\\boxed{}` of the row's `solution` (MATH-style rows), else `gold`."""
    solution = row.get("solution")
    if isinstance(solution, str):
        boxed = extract_boxed(solution)
        if boxed is not None and boxed.strip():
            return boxed
    return gold


def verify_answer(answer: str, gold: str) -> float:
    """1.0 when math-verify finds `answer` equivalent to `gold` (both LaTeX), else 0.0."""
    from math_verify import parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if not gold_parsed or not answer_parsed:
        return 0.0
    return float(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _start_worker() -> None:
    """Import math-verify once per worker; its 'timeout disabled' warning is about us."""
    import math_verify  # noqa: F401 - loaded before any call is timed

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _ready() -> int:
    return os.getpid()


def _new_pool() -> ProcessPoolExecutor:
    """A pool with all POOL_WORKERS started and warmed (so no timed call waits on a start)."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    pool = ProcessPoolExecutor(
        max_workers=POOL_WORKERS, mp_context=context, initializer=_start_worker
    )
    # Submitted together, each finds no idle worker, so each starts one.
    warm_ups = [pool.submit(_ready) for _ in range(POOL_WORKERS)]
    for warm_up in warm_ups:
        warm_up.result(timeout=_WARM_UP_TIMEOUT_S)
    return pool


def _current_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _new_pool()
        return _pool


def _recycle(pool: ProcessPoolExecutor) -> None:
    """Kill `pool`'s workers and forget it, unless another thread already replaced it."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    # ProcessPoolExecutor has no public way to stop a running call, so its workers are
    # killed (`_processes` is None once the pool has broken or shut down).
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def run_pooled(fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """`fn(*args)` in the grading pool; GradingTimeout (pool recycled) past `timeout_s`.

    The timeout counts the call's own running time only: a call waits, untimed, for one of
    the pool's `POOL_WORKERS` to be free (however many threads call at once), so a correct
    answer queued behind slow ones is never scored 0 for the wait.
    """
    last_error: BaseException | None = None
    for _attempt in range(_ATTEMPTS):
        with _running:
            pool = _current_pool()
            try:
                future: Future[Any] = pool.submit(fn, *args)
                return future.result(timeout=timeout_s)
            except FutureTimeout:
                _recycle(pool)
                raise GradingTimeout(
                    f"{getattr(fn, '__name__', fn)} ran past {timeout_s} s; its pool was recycled"
                ) from None
            except (BrokenProcessPool, RuntimeError, CancelledError) as error:
                # Another thread's timeout recycled this pool under us (RuntimeError: submit
                # after shutdown; CancelledError: cancelled with it): the call was not at
                # fault, so it runs again on a new pool.
                _recycle(pool)
                last_error = error
    raise RuntimeError(f"the grading pool broke {_ATTEMPTS} times in a row: {last_error!r}")


def verify_pooled(answer: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """`verify_answer` in the grading pool; 0.0 (and a warning) past `timeout_s`."""
    try:
        return run_pooled(verify_answer, answer, gold, timeout_s=timeout_s)
    except GradingTimeout:
        logger.warning(
            "math-verify ran past %s s on %r vs gold %r; scored 0",
            timeout_s,
            answer[:80],
            gold[:80],
        )
        return 0.0
