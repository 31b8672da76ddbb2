"""The local backend's single worker thread: all torch work of a service runs here.

Calls from any thread (or asyncio task) enqueue a job and get a PyTRIO `APIFuture` that
the worker resolves, like the remote service. Training jobs run in submission order.
Sampling requests are batched: when the worker takes one, it waits a moment for
more to arrive (a loop submitting a step's requests one by one takes well under a
millisecond each), then runs every queued request for the same weights as one batch.
Because a sequence's result does not depend on its batch (see ``sampler/``), batching
changes speed only, never samples.

At interpreter exit every worker is stopped and joined (queued jobs cancelled, a sampling
batch interrupted between decode steps): a daemon thread still inside torch when the
interpreter tears down aborts the whole process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import attrs
from pytrio.types import APIFuture, SampleResponse

from grpo.backends.local.sample_request import PendingSample

T = TypeVar("T")

COALESCE_QUIET_S = 0.002  # start the batch once no request arrived for this long
COALESCE_MAX_S = 0.02
MAX_BATCH_SEQUENCES = 512
EXIT_JOIN_TIMEOUT_S = 30.0


@attrs.frozen
class _Call:
    function: Callable[[], object]
    future: Future[object]


@attrs.frozen
class _Sample:
    key: object  # requests with the same key share weights and may share a batch
    run: Callable[[Sequence[PendingSample]], list[SampleResponse]]
    pending: PendingSample


class Worker:
    """One daemon thread draining a queue of training calls and sampling requests."""

    def __init__(self, name: str) -> None:
        self._queue: deque[_Call | _Sample] = deque()
        self._condition = threading.Condition()
        self._arrivals = 0
        self._closed = False
        self.stopping = threading.Event()  # long jobs (sampling) poll it and give up
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _LIVE_WORKERS.add(self)

    def call(self, function: Callable[[], T]) -> APIFuture[T]:
        """Run `function()` on the worker after every job submitted before it."""
        future: Future[T] = Future()
        self._put(_Call(function, future))  # type: ignore[arg-type]
        return APIFuture(future)

    def sample(
        self,
        key: object,
        run: Callable[[Sequence[PendingSample]], list[SampleResponse]],
        pending: PendingSample,
    ) -> APIFuture[SampleResponse]:
        """Queue a sampling request; `run` executes a batch of requests sharing `key`."""
        self._put(_Sample(key, run, pending))
        return APIFuture(pending.future)

    def close(self) -> None:
        """Stop after the queued jobs (idempotent; does not wait)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def stop(self, timeout: float | None = EXIT_JOIN_TIMEOUT_S) -> None:
        """Cancel queued jobs, interrupt sampling, and wait for the running job to end."""
        with self._condition:
            self._closed = True
            abandoned = list(self._queue)
            self._queue.clear()
            self._condition.notify_all()
        self.stopping.set()
        for job in abandoned:
            (job.future if isinstance(job, _Call) else job.pending.future).cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _put(self, job: _Call | _Sample) -> None:
        with self._condition:
            if self._closed:
                raise RuntimeError(
                    "this local service client is closed; create a new LocalServiceClient"
                )
            self._queue.append(job)
            self._arrivals += 1
            self._condition.notify_all()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                batch = self._take_batch(job) if isinstance(job, _Sample) else None
            if isinstance(job, _Call):
                _run_call(job)
            else:
                assert batch is not None
                _run_batch(batch)
            # Drop the references now: a freed client's trainer must not wait in these
            # locals for the next job to be collected.
            job = batch = None

    def _take_batch(self, first: _Sample) -> list[_Sample]:
        """Wait for stragglers (under the lock), then remove every queued request with the key."""
        started = time.monotonic()
        seen = self._arrivals
        while time.monotonic() - started < COALESCE_MAX_S:
            self._condition.wait(COALESCE_QUIET_S)
            if self._arrivals == seen:
                break
            seen = self._arrivals
        batch = [first]
        sequences = first.pending.spec.num_samples
        remaining: deque[_Call | _Sample] = deque()
        for job in self._queue:
            if (
                isinstance(job, _Sample)
                and job.key is first.key
                and sequences + job.pending.spec.num_samples <= MAX_BATCH_SEQUENCES
            ):
                batch.append(job)
                sequences += job.pending.spec.num_samples
            else:
                remaining.append(job)
        self._queue = remaining
        return batch


_LIVE_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


@atexit.register
def _stop_workers_at_exit() -> None:
    for worker in list(_LIVE_WORKERS):
        worker.stop()


def _run_call(job: _Call) -> None:
    if not job.future.set_running_or_notify_cancel():
        return
    try:
        result = job.function()
    except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller's future
        job.future.set_exception(error)
    else:
        job.future.set_result(result)


def _run_batch(batch: list[_Sample]) -> None:
    live = [job for job in batch if job.pending.future.set_running_or_notify_cancel()]
    if not live:
        return
    try:
        responses = live[0].run([job.pending for job in live])
    except BaseException as error:  # noqa: BLE001 - the batch's failure belongs to every request in it
        for job in live:
            job.pending.future.set_exception(error)
        return
    for job, response in zip(live, responses, strict=True):
        job.pending.future.set_result(response)
