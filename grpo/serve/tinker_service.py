"""The state behind `grpo serve`'s Tinker route: sessions, models, sampling sessions, futures.

A Tinker model is a `LocalTrainingClient` of the server's local backend made with the
``sum`` normalization (Tinker's built-in losses are sums over tokens, no divisor); its id is
the client's run id, so ``tinker://RUN/weights/NAME`` is ``<root>/RUN/weights/NAME`` in the
local store. Every training request runs as a future: submitted in the SDK's ``seq_id``
order (a request whose predecessor has not arrived waits for it, at most
``SEQUENCE_WAIT_S``), a retried ``seq_id`` answers the future it already made (idempotent),
and ``retrieve_future`` long-polls it. A failed computation is a finished future with
``{error, category: "user"}`` (a bug: ``"server"``); a refused request is a 400 at submit.

A session lives while its client is: the SDK heartbeats every 10 s, and any request naming
the session, one of its training clients or its sampling sessions counts as one. A session
silent for ``session_expiry_s`` (``grpo serve --tinker-session-expiry``, default
`SESSION_EXPIRY_S`) expires, as one finished without `finish_session` would: its training
clients and sampling sessions are freed, and a request on it is a 400 saying to make a new
ServiceClient (its heartbeat a 410, which ends the SDK's heartbeat loop).
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
SESSION_EXPIRY_S = 600.0
"""A session silent this long expires: 60 of the SDK's heartbeats (every 10 s) missed."""
SESSION_SWEEP_MAX_S = 30.0
GATE_MAX_S = 0.05
"""The longest a sampling session's first request waits for the rest of its step's burst."""
_FUTURES_KEPT = 4096
_SAMPLERS_KEPT = 32
_CLOSED_SESSIONS_KEPT = 4096


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


@attrs.define
class _Gate:
    """A sampling session's first burst: its requests held until `expected` arrived."""

    expected: int
    deadline: float
    held: list[tuple[Callable[[], Pending], Future]] = attrs.field(factory=list)
    open: bool = False


class TinkerService:
    """The Tinker route's sessions, models, samplers and futures (all methods thread-safe)."""

    def __init__(
        self,
        registry: RunRegistry,
        stopping: threading.Event,
        *,
        session_expiry_s: float = SESSION_EXPIRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not session_expiry_s > 0:
            raise ValueError(f"--tinker-session-expiry must be > 0 seconds, got {session_expiry_s}")
        self.registry = registry
        self.stopping = stopping
        self.session_expiry_s = session_expiry_s
        self.clock = clock
        self._sweeper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._sessions: dict[str, dict[str, Any]] = {}
        self._models: dict[str, TinkerModel] = {}
        self._samplers: collections.OrderedDict[
            str, tuple[LocalSamplingClient, str, str | None, str]
        ]
        self._samplers = collections.OrderedDict()
        self._futures: collections.OrderedDict[str, Pending] = collections.OrderedDict()
        self._samples: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        # the sampling bursts of each training client's samplers, to gather the next one
        self._sample_counts: dict[str, int] = {}  # sampling session -> its requests
        self._model_samplers: dict[str, list[str]] = {}  # model id -> its last samplers
        self._gates: collections.OrderedDict[str, _Gate] = collections.OrderedDict()
        self._gate_turn = threading.Condition(self._lock)

    # --- sessions ----------------------------------------------------------------------

    def create_session(self) -> str:
        """A new session's id (and the first sweep of silent sessions starts its thread)."""
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[session_id] = {
                "finished": False,
                "expired": False,
                "heartbeat": self.clock(),
                "models": [],
                "samplers": [],
            }
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep, name="grpo-serve-tinker-sessions", daemon=True
                )
                self._sweeper.start()
        return session_id

    def session(self, session_id: str) -> dict[str, Any]:
        """An open session, its heartbeat renewed; 404 when unknown, 400 when finished or
        expired (the message says to make a new ServiceClient)."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is not None and not found["finished"]:
                found["heartbeat"] = self.clock()
        if found is None:
            raise not_found("session", session_id)
        if found["finished"]:
            raise self._closed_error(session_id, found)
        return found

    def heartbeat(self, session_id: str) -> None:
        """Renew a session; 410 when it was finished or expired (the SDK then stops
        heartbeating it), 404 when unknown."""
        try:
            self.session(session_id)
        except ServeError as error:
            if error.code in ("validation.session_finished", "validation.session_expired"):
                raise ServeError(410, error.code, error.message) from None
            raise

    def _closed_error(self, session_id: str, record: dict[str, Any]) -> ServeError:
        if record["expired"]:
            return ServeError(
                400,
                "validation.session_expired",
                f"session_id {session_id!r} expired: no heartbeat or request for "
                f"{self.session_expiry_s:g} s (grpo serve --tinker-session-expiry), so its "
                "training and sampling clients were freed; make a new ServiceClient (and "
                "resume from a saved state with create_training_client_from_state)",
            )
        return ServeError(
            400,
            "validation.session_finished",
            f"session_id {session_id!r} was finished; make a new ServiceClient",
        )

    def _touch(self, session_id: str) -> None:
        """Count a request on one of the session's clients as a heartbeat (under the lock)."""
        record = self._sessions.get(session_id)
        if record is not None and not record["finished"]:
            record["heartbeat"] = self.clock()

    def finish_session(self, session_id: str) -> None:
        """Finish a session and free its models' trainers (idempotent)."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None:
                raise not_found("session", session_id)
            self._close_session(session_id, found, expired=False)

    def _close_session(self, session_id: str, record: dict[str, Any], *, expired: bool) -> None:
        """Mark a session finished (or expired) and free its training clients; an expired
        session's sampling sessions too (under the lock)."""
        if record["finished"]:
            return
        record["finished"], record["expired"] = True, expired
        for model_id in [m for m, item in self._models.items() if item.session_id == session_id]:
            del self._models[model_id]  # its adapter is freed with the client
            for key in self._model_samplers.pop(model_id, []):
                self._sample_counts.pop(key, None)
        if expired:
            for sampler_id in record["samplers"]:
                self._samplers.pop(sampler_id, None)
        closed = [key for key, item in self._sessions.items() if item["finished"]]
        for key in closed[: max(0, len(closed) - _CLOSED_SESSIONS_KEPT)]:
            del self._sessions[key]

    def expire_silent_sessions(self) -> list[str]:
        """Expire every open session silent for more than `session_expiry_s`; their ids."""
        with self._lock:
            now = self.clock()
            silent = [
                (key, record)
                for key, record in self._sessions.items()
                if not record["finished"] and now - record["heartbeat"] > self.session_expiry_s
            ]
            for key, record in silent:
                self._close_session(key, record, expired=True)
        return [key for key, _ in silent]

    def _sweep(self) -> None:
        """Expire silent sessions every quarter of the expiry (at most `SESSION_SWEEP_MAX_S`)
        until the server stops."""
        interval = min(self.session_expiry_s / 4, SESSION_SWEEP_MAX_S)
        while not self.stopping.wait(interval):
            self.expire_silent_sessions()

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
        """A live model (its session's heartbeat renewed); 400 when its session was finished
        or expired, 404 naming it when unknown."""
        with self._lock:
            found = self._models.get(model_id)
            if found is not None:
                self._touch(found.session_id)
                return found
            owner = self._owner("models", model_id)
        if owner is not None:
            raise self._closed_error(*owner)
        raise not_found("model_id", model_id)

    def _owner(self, kind: str, member: str) -> tuple[str, dict[str, Any]] | None:
        """The closed session that had `member` among its `kind` (under the lock), or None."""
        for key, record in self._sessions.items():
            if record["finished"] and member in record[kind]:
                return key, record
        return None

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
        self,
        sampler: LocalSamplingClient,
        base_model: str,
        path: str | None,
        owner: str,
        model_id: str | None = None,
    ) -> str:
        """A new sampling session's id for `sampler`, made in session `owner` (the most
        recent few are kept); `model_id` when a training client made it of its weights.

        A training client's samplers whose last two each got the same number N > 1 of
        requests (rl_loop: one sampler a step, N prompts each) get a gate: the new one's
        requests are held until N arrived (at most `GATE_MAX_S`) and go to the worker
        together, as one batch; requests that the SDK sends one by one reach the server
        spread over ms (tens beside other work), and a batch started on the first few makes
        the rest wait for a second one."""
        session_id = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._samplers[session_id] = (sampler, base_model, path, owner)
            members = self._sessions.get(owner, {}).get("samplers")
            if members is not None:
                members.append(session_id)
                del members[:-_SAMPLERS_KEPT]
            while len(self._samplers) > _SAMPLERS_KEPT:
                self._samplers.popitem(last=False)
            if model_id is not None:
                earlier = self._model_samplers.setdefault(model_id, [])
                counts = [self._sample_counts.get(key, 0) for key in earlier]
                if len(counts) == 2 and counts[0] == counts[1] > 1:
                    self._gates[session_id] = _Gate(counts[0], float("inf"))
                    while len(self._gates) > _SAMPLERS_KEPT:
                        self._gates.popitem(last=False)
                for key in earlier[:-1]:
                    self._sample_counts.pop(key, None)
                earlier[:] = [*earlier[-1:], session_id]
                self._sample_counts[session_id] = 0
        return session_id

    def sampler(self, session_id: str) -> tuple[LocalSamplingClient, str, str | None]:
        """A sampling session's sampler, base model and model path (its session's heartbeat
        renewed); 400 when its session expired, 404 when unknown."""
        with self._lock:
            found = self._samplers.get(session_id)
            if found is not None:
                self._samplers.move_to_end(session_id)
                self._touch(found[3])
                return found[:3]
            owner = self._owner("samplers", session_id)
        if owner is not None and owner[1]["expired"]:
            raise self._closed_error(*owner)
        raise not_found("sampling_session_id", session_id)

    def sample_once(
        self, key: tuple[str, int] | None, start: Callable[[], Pending], session: str | None = None
    ) -> str:
        """The request id of sample request `key` (sampling session, seq_id): the one already
        made for a retry, else `start()`ed now, or with the rest of its burst when sampling
        session `session` has a gate (`add_sampler`; no key: never a retry)."""
        if key is not None:
            with self._lock:
                if key in self._samples:
                    return self._samples[key]
        request_id = self.add_future(self._gated(session, start))
        if key is None:
            return request_id
        with self._lock:
            request_id = self._samples.setdefault(key, request_id)
            while len(self._samples) > _FUTURES_KEPT:
                self._samples.popitem(last=False)
        return request_id

    def _gated(self, session: str | None, start: Callable[[], Pending]) -> Pending:
        """`start()` now, or (a protobuf result) once the session's gate opens: the first
        request of the burst waits for the rest (at most `GATE_MAX_S`), then starts them all
        in arrival order; a start that fails is a failed future."""
        with self._lock:
            if session in self._sample_counts:
                self._sample_counts[session] += 1
            gate = self._gates.get(session) if session is not None else None
            if gate is None or gate.open:
                held = None
            else:
                target: Future = Future()
                gate.held.append((start, target))
                if len(gate.held) > 1:
                    self._gate_turn.notify_all()
                    return Pending(target, proto=True)
                self._gate_turn.wait_for(
                    lambda: len(gate.held) >= gate.expected or self.stopping.is_set(),
                    timeout=GATE_MAX_S,
                )
                gate.open = True
                held = list(gate.held)
                gate.held.clear()
        if held is None:
            return start()
        for start_held, target_held in held:
            try:
                relay(start_held().future, target_held)
            except BaseException as error:  # noqa: BLE001 - the request's own failure
                target_held.set_exception(error)
        return Pending(held[0][1], proto=True)

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


def relay(source: Future, target: Future) -> None:
    """Resolve `target` as `source` resolves (its result or its failure)."""

    def copy(finished: Future) -> None:
        error = finished.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(finished.result())

    source.add_done_callback(copy)


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
