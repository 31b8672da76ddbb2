"""The ``_async`` twins of the local clients' calls, made from the sync call.

PyTRIO pairs every client call ``x`` with an ``x_async``. A local twin is made from ``x``
itself, so it takes exactly ``x``'s arguments (one signature, stated once) and comes in
one of three forms:

- ``returning_future(x)``: awaiting ``x_async(...)`` gives the ``APIFuture`` that ``x``
  gives (the training calls: ``x`` queues the work on the worker and returns at once);
- ``awaiting_future(x)``: awaiting ``x_async(...)`` gives the result of ``x``'s future
  (the sampling calls, as PyTRIO's do);
- ``in_thread(x)``: ``x`` runs on a thread and awaiting gives what it returns (calls that
  block: loading a model or a checkpoint).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

__all__ = ["awaiting_future", "in_thread", "returning_future"]

P = ParamSpec("P")
R = TypeVar("R")


def _twin_of(
    call: Callable[P, Any], twin: Callable[P, Coroutine[Any, Any, R]], returns: str
) -> Callable[P, Coroutine[Any, Any, R]]:
    """`twin` named ``<call>_async``, with `call`'s signature and a docstring saying what it
    `returns`."""
    functools.update_wrapper(twin, call)
    twin.__name__ = f"{call.__name__}_async"
    twin.__qualname__ = f"{call.__qualname__}_async"
    twin.__doc__ = f"Async twin of `{call.__name__}` ({returns})."
    return twin


def returning_future(call: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The async twin of `call` whose await gives what `call` returns (its future)."""

    async def twin(*args: P.args, **kwargs: P.kwargs) -> R:
        return call(*args, **kwargs)

    return _twin_of(call, twin, "returns its future")


def awaiting_future(call: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The async twin of `call` whose await gives the result of the future `call` returns."""

    async def twin(*args: P.args, **kwargs: P.kwargs) -> R:
        return await call(*args, **kwargs)

    return _twin_of(call, twin, "returns its future's result, as PyTRIO's does")


def in_thread(call: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The async twin of `call` that runs it on a thread (``asyncio.to_thread``)."""

    async def twin(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(call, *args, **kwargs)

    return _twin_of(call, twin, "runs it on a thread")
