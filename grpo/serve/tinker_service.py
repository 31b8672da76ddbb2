"""The state behind `grpo serve`'s Tinker route: sessions, models, sampling sessions, futures.

A Tinker model is a `LocalTrainingClient` of the server's local backend made with the
``sum`` normalization (Tinker's built-in losses are sums over tokens, no divisor); its id is
the client's run id, so ``tinker://RUN/weights/NAME`` is ``<root>/RUN/weights/NAME`` in the
local store. Every training request runs as a future: submitted in the SDK's ``seq_id``
order (a request whose predecessor has not arrived waits for it, at most
``SEQUENCE_WAIT_S``), a retried ``seq_id`` answers the future it already made (idempotent),
and ``retrieve_future`` long-polls it. A failed computation is a finished future with
``{error, category: "user"}`` (a bug: ``"server"``); a refused request is a 400 at submit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs
from pytrio.errors.base import PyTrioError

from grpo.backends.local import LocalSamplingClient, LocalTrainingClient
from grpo.serve.registry import RunRegistry
from grpo.serve.wire import ServeError, chain, local_call, not_found

MAX_LONG_POLL_S = 20.0
SEQUENCE_WAIT_S = 5.0
_FUTURES_KEPT = 4096
_SAMPLERS_KEPT = 32


@attrs.define
class TinkerModel:
    """One training client of a session: its local client, base model and seq_id ledger."""

    model_id: str
    base_model: str
    rank: int
    client: LocalTrainingClient
    session_id: str
    created: str = ""  # the request id of its create_model / load_weights
    created_unix: float = attrs.field(factory=time.time)
    user_metadata: dict[str, str] | None = None
    requests: dict[int, str] = attrs.field(factory=dict)  # seq_id -> request id
    last_seq: int = 0
    turn: threading.Condition = attrs.field(factory=threading.Condition)


@attrs.define
class Pending:
    """A submitted request: its future (a JSON dict or protobuf bytes when done)."""

    future: Future
    proto: bool = False


def failure_body(error: BaseException) -> dict[str, Any]:
    """The finished-future body of a failure: the user's (``category: user``) unless a bug."""
    if isinstance(error, (ServeError, PyTrioError)):
        return {"error": error.message, "category": "user"}
    if isinstance(error, (ValueError, TypeError, KeyError)):
        return {"error": str(error), "category": "user"}
    return {"error": f"{type(error).__name__}: {error}", "category": "server"}


class TinkerService:
    """The Tinker route's sessions, models, samplers and futures (all methods thread-safe)."""

    def __init__(self, registry: RunRegistry, stopping: threading.Event) -> None:
        self.registry = registry
        self.stopping = stopping
        self._lock = threading.Lock()
        self._sessions: dict[str, dict[str, Any]] = {}
        self._models: dict[str, TinkerModel] = {}
        self._samplers: collections.OrderedDict[str, tuple[LocalSamplingClient, str, str | None]]
        self._samplers = collections.OrderedDict()
        self._futures: collections.OrderedDict[str, Pending] = collections.OrderedDict()
        self._samples: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()

    # --- sessions ----------------------------------------------------------------------

    def create_session(self) -> str:
        """A new session's id."""
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[session_id] = {
                "finished": False,
                "heartbeat": time.monotonic(),
                "models": [],
                "samplers": [],
            }
        return session_id

    def session(self, session_id: str) -> dict[str, Any]:
        """An open session; 404 when unknown, 400 when finished."""
        with self._lock:
            found = self._sessions.get(session_id)
        if found is None:
            raise not_found("session", session_id)
        if found["finished"]:
            raise ServeError(
                400,
                "validation.session_finished",
                f"session_id {session_id!r} was finished; make a new ServiceClient",
            )
        found["heartbeat"] = time.monotonic()
        return found

    def finish_session(self, session_id: str) -> None:
        """Finish a session and free its models' trainers (idempotent)."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None:
                raise not_found("session", session_id)
            found["finished"] = True
            for model_id in [
                m for m, item in self._models.items() if item.session_id == session_id
            ]:
                del self._models[model_id]  # its adapter is freed with the client

    def session_ids(self) -> list[str]:
        """Every session of this process, oldest first."""
        with self._lock:
            return list(self._sessions)

    def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """A session's training run ids and sampling session ids; 404 when unknown."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None:
                raise not_found("session_id", session_id)
            return list(found["models"]), list(found["samplers"])

    # --- models ------------------------------------------------------------------------

    def add_model(self, model: TinkerModel) -> None:
        """Register a created (or loaded) training client."""
        with self._lock:
            self._models[model.model_id] = model
            members = self._sessions.get(model.session_id, {}).get("models")
            if members is not None and model.model_id not in members:
                members.append(model.model_id)

    def live_models(self) -> list[TinkerModel]:
        """The training clients of unfinished sessions, oldest first."""
        with self._lock:
            return sorted(self._models.values(), key=lambda model: model.created_unix)

    def find_model(self, model_id: str) -> TinkerModel | None:
        """A live model, or None."""
        with self._lock:
            return self._models.get(model_id)

    def model(self, model_id: str) -> TinkerModel:
        """A live model; 404 naming it when unknown."""
        with self._lock:
            found = self._models.get(model_id)
        if found is None:
            raise not_found("model_id", model_id)
        return found

    def in_order(self, model: TinkerModel, seq_id: int | None, start: Callable[[], Pending]) -> str:
        """The request id of `model`'s request `seq_id`: the one already made for a retried
        seq_id, else `start()`ed once its predecessors were submitted (or after
        `SEQUENCE_WAIT_S`). A refused start consumes its seq_id too."""
        with model.turn:
            if seq_id is not None and seq_id in model.requests:
                return model.requests[seq_id]
            if seq_id is not None:
                model.turn.wait_for(
                    lambda: model.last_seq >= seq_id - 1 or self.stopping.is_set(),
                    timeout=SEQUENCE_WAIT_S,
                )
            try:
                pending = start()
            finally:
                if seq_id is not None:
                    model.last_seq = max(model.last_seq, seq_id)
                model.turn.notify_all()
            request_id = self.add_future(pending)
            if seq_id is not None:
                model.requests[seq_id] = request_id
                while len(model.requests) > _FUTURES_KEPT:
                    model.requests.pop(min(model.requests))
            return request_id

    # --- samplers ----------------------------------------------------------------------

    def add_sampler(
        self, sampler: LocalSamplingClient, base_model: str, path: str | None, owner: str
    ) -> str:
        """A new sampling session's id for `sampler`, made in session `owner` (the most
        recent few are kept)."""
        session_id = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._samplers[session_id] = (sampler, base_model, path)
            members = self._sessions.get(owner, {}).get("samplers")
            if members is not None:
                members.append(session_id)
                del members[:-_SAMPLERS_KEPT]
            while len(self._samplers) > _SAMPLERS_KEPT:
                self._samplers.popitem(last=False)
        return session_id

    def sampler(self, session_id: str) -> tuple[LocalSamplingClient, str, str | None]:
        """A sampling session's sampler, base model and model path; 404 when unknown."""
        with self._lock:
            found = self._samplers.get(session_id)
            if found is not None:
                self._samplers.move_to_end(session_id)
        if found is None:
            raise not_found("sampling_session_id", session_id)
        return found

    def sample_once(self, key: tuple[str, int] | None, start: Callable[[], Pending]) -> str:
        """The request id of sample request `key` (sampling session, seq_id): the one already
        made for a retry, else `start()`ed now (no key: always started)."""
        if key is None:
            return self.add_future(start())
        with self._lock:
            if key in self._samples:
                return self._samples[key]
        request_id = self.add_future(start())
        with self._lock:
            request_id = self._samples.setdefault(key, request_id)
            while len(self._samples) > _FUTURES_KEPT:
                self._samples.popitem(last=False)
        return request_id

    # --- futures -----------------------------------------------------------------------

    def add_future(self, pending: Pending) -> str:
        """Keep a submitted request's future; its request id."""
        request_id = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._futures[request_id] = pending
            while len(self._futures) > _FUTURES_KEPT:
                self._futures.popitem(last=False)
        return request_id

    def poll(self, request_id: str, wait_s: float = MAX_LONG_POLL_S) -> tuple[Pending, bool]:
        """The request's pending entry once done (True) or after `wait_s` / at stop (False)."""
        with self._lock:
            pending = self._futures.get(request_id)
        if pending is None:
            raise not_found("request_id", request_id)
        deadline = time.monotonic() + wait_s
        while not pending.future.done() and not self.stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            concurrent.futures.wait([pending.future], timeout=min(remaining, 0.5))
        return pending, pending.future.done()


def done(value: Any, *, proto: bool = False) -> Pending:
    """A request that finished at submit (a save of metadata, a created model)."""
    future: Future = Future()
    future.set_result(value)
    return Pending(future, proto)


def running(source: Any, convert: Callable[[Any], Any], *, proto: bool = False) -> Pending:
    """A request resolved by `convert(result)` when the local backend's future `source` is done."""
    future: Future = Future()
    chain(source, future, convert)
    return Pending(future, proto)


def submitted(call: Callable[[], Pending]) -> Callable[[], Pending]:
    """`call` with the local backend's validation errors as 400s naming the field."""
    return lambda: local_call(call)
