"""Stopping within seconds on Ctrl-C: pools that drop their queued work, waits that give up.

Two things kept a stopped command alive long after its signal: a `ThreadPoolExecutor` left
by an exception (KeyboardInterrupt included) through ``with`` still runs every call queued
on it before it returns; and at exit the interpreter joins every pool thread, so a thread
still waiting on a request keeps the process alive until the request is answered.

- `dropping_pool`: a thread pool that, left by an exception, cancels its queued calls and
  does not wait for the running ones (left normally, it waits for them as ``with`` does).
- `request_result`: a request's result, waited in short slices; the wait gives up
  (`ProcessExiting`) once the interpreter starts to exit, so a pool thread never holds the
  process at exit. The request itself is the backend's to end (the local backend stops its
  sampling between decode steps at exit).
- `exit_without_collecting`: a stopped command's interpreter exit skips the garbage
  collector's passes over the heap (half a million objects once torch and transformers are
  loaded: 10 s and more on a loaded 2-core machine; the memory goes back to the system
  anyway).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import importlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol, TypeVar

__all__ = ["ProcessExiting", "dropping_pool", "exit_without_collecting", "request_result"]

T_co = TypeVar("T_co", covariant=True)
R = TypeVar("R")

POLL_S = 0.1

_EXITING = threading.Event()
# Set when the interpreter starts to exit, before it joins the pools' threads (Python runs
# concurrent.futures' join among the threading atexit hooks, while the main thread still
# counts as alive). Hooks run last registered first, so concurrent.futures is imported
# before this one is registered. A private hook, hence the guard (as `grpo.envs.base`).
importlib.import_module("concurrent.futures.thread")
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_EXITING.set)


class ProcessExiting(RuntimeError):
    """The main thread ended while this thread waited on a request (the process is exiting)."""


class _Awaitable(Protocol[T_co]):
    def result(self, timeout: float | None = None) -> T_co: ...

    def done(self) -> bool: ...


@contextmanager
def dropping_pool(max_workers: int, name: str = "") -> Iterator[ThreadPoolExecutor]:
    """A thread pool that, left by an exception (Ctrl-C included), cancels the calls not yet
    started and returns without waiting for the running ones; left normally, it waits."""
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def request_result(future: _Awaitable[R]) -> R:
    """`future.result()`, unless the interpreter starts to exit first: then `ProcessExiting`."""
    if not callable(getattr(future, "done", None)):  # a bare result (a test's double): no wait
        return future.result()
    main = threading.main_thread()
    while True:
        try:
            return future.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            if future.done():  # the request's own TimeoutError, not the end of this slice
                raise
        exiting = _EXITING.is_set() or not main.is_alive()
        if exiting and threading.current_thread() is not main:
            raise ProcessExiting("the process is exiting; this request was abandoned")


def exit_without_collecting() -> None:
    """At this process's exit, freeze the heap so that the interpreter's final collections
    skip it (objects freed by reference counting still are); for a command about to end."""
    atexit.register(gc.freeze)
