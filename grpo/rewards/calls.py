"""Calling rewards: in this process (built-ins), or in worker processes with a timeout (plugins).

Where a reward runs:

- built-in rewards (`grpo.rewards`, `grpo.core.rewards`; they bound their own time) and
  every reward under `--reward-timeout 0` run in this process: serially, or on
  `--reward-workers` threads. The default run (`grpo.rewards:boxed_match`) takes this path,
  unchanged.
- any other reward (a user plugin) under `--reward-timeout T > 0` runs in
  `max(1, --reward-workers)` worker processes (spawned once per run, SIGINT ignored there):
  a call that does not answer within T seconds of the previous answer is a timeout (the
  workers are killed and restarted), and a stop request (Ctrl-C, SIGTERM) kills them at
  once, so the run stops with a checkpoint even while a reward hangs.

Every call gets its own copy of the row (a fresh unpickled one in a worker, a deep copy
in this process for plugins), so a reward that writes into `row` never sees its writes on a
later call, and a resumed run scores exactly what an uninterrupted one does.

A call's result is its checked values, or `CallFailed` (it raised or returned a
non-number), `CallTimedOut` or `CallExited` (it raised SystemExit or KeyboardInterrupt).
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.pool
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import attrs

from grpo.core.rewards import RewardInput
from grpo.rewards import RewardFn, checked_values, load_rewards

__all__ = [
    "CallExited",
    "CallFailed",
    "CallTimedOut",
    "RewardCaller",
    "RewardStartError",
    "active_caller",
    "reward_session",
    "uses_processes",
]

BUILTIN_MODULES = frozenset({"grpo.rewards", "grpo.core.rewards"})
_POLL_S = 0.05
_START_S = 60.0  # the workers' start (imports) may take longer than one call may
_WORKER_REWARDS: tuple[RewardFn, ...] = ()
_ACTIVE: ContextVar[RewardCaller | None] = ContextVar("grpo_reward_caller", default=None)

Call = tuple[int, tuple[str, Mapping[str, Any], RewardInput]]


@attrs.frozen
class CallFailed:
    """The reward raised an exception or returned something that is not a finite number."""

    why: str


@attrs.frozen
class CallTimedOut:
    """The reward did not return within the timeout."""

    seconds: float


@attrs.frozen
class CallExited:
    """The reward raised SystemExit or KeyboardInterrupt (it may not end the run)."""

    why: str


class RewardStartError(RuntimeError):
    """The worker processes of the plugin rewards did not start."""


Result = dict[str, float] | CallFailed | CallTimedOut | CallExited


def is_builtin(reward: RewardFn) -> bool:
    """Whether the reward is one of grpo's own (trusted: bounded time, never writes the row)."""
    return getattr(reward.fn, "__module__", None) in BUILTIN_MODULES


def uses_processes(rewards: Sequence[RewardFn], timeout: float) -> bool:
    """Worker processes when a timeout is asked and some reward is a user plugin."""
    return timeout > 0 and not all(is_builtin(reward) for reward in rewards)


def call_one(
    reward: RewardFn, completion: str, row: Mapping[str, Any], sample: RewardInput
) -> Result:
    """One reward call, checked: its named values or why it failed (never raises)."""

    try:
        value = reward(completion, row, sample)
    except (SystemExit, KeyboardInterrupt) as error:
        return CallExited(f"raised {type(error).__name__}({_args(error)})")
    except Exception as error:  # noqa: BLE001 - the user's reward; reported with its input
        return CallFailed(f"raised {type(error).__name__}: {error}")
    checked = checked_values(reward, value)
    return CallFailed(checked) if isinstance(checked, str) else checked


def _args(error: BaseException) -> str:
    return ", ".join(repr(arg) for arg in error.args)


def _worker_start(specs: tuple[str, ...]) -> None:
    """A worker process: ignore SIGINT (the parent decides), load the rewards once."""
    global _WORKER_REWARDS
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    _WORKER_REWARDS = load_rewards(specs)


def _worker_ready(_index: int) -> bool:
    time.sleep(0.01)  # spread the pings over the workers
    return True


def _worker_call(
    which: int, completion: str, row: Mapping[str, Any], sample: RewardInput
) -> Result:
    return call_one(_WORKER_REWARDS[which], completion, row, sample)


@attrs.define(eq=False)
class RewardCaller:
    """Calls a run's rewards the way `uses_processes` says; `close()` ends its workers."""

    rewards: tuple[RewardFn, ...] = attrs.field(converter=tuple)
    workers: int = attrs.field(default=0, kw_only=True)
    timeout: float = attrs.field(default=0.0, kw_only=True)
    stop: threading.Event | None = attrs.field(default=None, kw_only=True)
    note: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)
    judge: Any = attrs.field(default=None, kw_only=True)
    """The run's judge (`grpo.rewards.judges.Judge`) for the judge rewards, else None."""
    processes: bool = attrs.field(init=False)
    _pool: multiprocessing.pool.Pool | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.processes = uses_processes(self.rewards, self.timeout)

    def results(self, calls: Sequence[Call]) -> list[Result]:
        """The result of every (reward index, (completion, row, sample)), in order."""
        if self.processes:
            return self._in_processes(calls)
        copy_row = not all(is_builtin(reward) for reward in self.rewards)

        def one(call: Call) -> Result:
            which, (completion, row, sample) = call
            return call_one(
                self.rewards[which], completion, copy.deepcopy(row) if copy_row else row, sample
            )

        if self.workers > 0:
            with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reward") as pool:
                return list(pool.map(one, calls))
        return [one(call) for call in calls]

    def _start(self) -> multiprocessing.pool.Pool:
        context = multiprocessing.get_context("spawn")
        size = max(1, self.workers)
        pool = context.Pool(
            size, initializer=_worker_start, initargs=(tuple(r.spec for r in self.rewards),)
        )
        waiting = pool.map_async(_worker_ready, range(size), chunksize=1)
        start_s = max(self.timeout, _START_S)
        deadline = time.monotonic() + start_s
        try:
            while not waiting.ready():
                self._check_stop()
                if time.monotonic() > deadline:
                    raise RewardStartError(
                        f"the reward worker processes did not start within {start_s:g}s "
                        "(a script that calls grpo.train must do so under "
                        "`if __name__ == '__main__':`, as each worker imports the script); or "
                        "pass --reward-timeout 0 to call the rewards in this process"
                    )
                waiting.wait(_POLL_S)
            waiting.get()
        except BaseException:
            pool.terminate()
            raise
        return pool

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            self.close()
            raise KeyboardInterrupt

    def _in_processes(self, calls: Sequence[Call]) -> list[Result]:
        results: list[Result | None] = [None] * len(calls)
        position = 0
        while position < len(calls):
            if self._pool is None:
                self._pool = self._start()
            pending = [
                self._pool.apply_async(_worker_call, (which, *item))
                for which, item in calls[position:]
            ]
            for offset, waiting in enumerate(pending):
                # Answers are awaited in order, so the call awaited has run at least as long
                # as it has been awaited: no call is cut short before its timeout.
                since = time.monotonic()
                while not waiting.ready():
                    self._check_stop()
                    if time.monotonic() - since > self.timeout:
                        break
                    waiting.wait(_POLL_S)
                if not waiting.ready():
                    results[position + offset] = CallTimedOut(self.timeout)
                    self.close()  # the hung worker cannot be stopped alone
                    position += offset + 1
                    break
                try:
                    results[position + offset] = waiting.get()
                except Exception as error:  # noqa: BLE001 - e.g. an argument that cannot be pickled
                    results[position + offset] = CallFailed(
                        f"could not be called in a worker process: {type(error).__name__}: {error}"
                    )
            else:
                position = len(calls)
        return [result for result in results if result is not None]

    def close(self) -> None:
        """Kill the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def active_caller() -> RewardCaller | None:
    """The caller of the run in progress in this context (None outside `reward_session`)."""
    return _ACTIVE.get()


@contextmanager
def reward_session(
    rewards: Sequence[RewardFn],
    *,
    workers: int,
    timeout: float,
    stop: threading.Event | None,
    note: Callable[[str], None] | None = None,
    judge: Any = None,
) -> Iterator[RewardCaller]:
    """A run's reward caller for the duration of its steps (workers kept across steps)."""
    caller = RewardCaller(
        rewards, workers=workers, timeout=timeout, stop=stop, note=note, judge=judge
    )
    token = _ACTIVE.set(caller)
    try:
        yield caller
    finally:
        _ACTIVE.reset(token)
        caller.close()
