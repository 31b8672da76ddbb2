"""OpenEnv environments served over the network, driven as our `Env`: `--env openenv:MODULE:CLIENT`.

`CLIENT` is an OpenEnv environment client class (a subclass of `openenv.core.EnvClient`,
package `openenv-core`, the optional extra: ``pip install -e ".[openenv]"``);
``--env-arg base_url=URL`` names the server. Each episode is one session (one WebSocket
connection, its own environment instance on the server):

- `initial_observation()`: connect, ``reset(seed=<task index>, **reset args)`` (the G
  episodes of a group share a seed, so a seeded server gives them one problem); the run's
  system messages, then the observation as chat messages.
- `step(action_text)`: the text as the client's action, ``step(action)``; the server's
  reward (None: 0) and ``done``; the observation as the next messages. The session is
  closed when the episode is done, and at the episode's end (`close`).

Mapping (`observation_messages`, `text_action`): an observation with a ``messages`` list of
{role, content} is those messages; one with a single text field is a user message of it;
any other is a user message of its fields as JSON (without ``done``, ``reward``,
``metadata``). An action type with exactly one text field (besides ``metadata``) is built
from the text; for others give hooks: ``--env-arg action=MODULE:FUNCTION`` (text -> the
client's action) and ``--env-arg observation=MODULE:FUNCTION`` (observation -> messages).
Every other ``KEY=VALUE`` goes to the server's ``reset`` (JSON values are parsed: numbers,
booleans; anything else is a string).

Calls are bounded by --env-timeout (the client's connect and message timeouts, and our
own bound of every call, `grpo.envs.base`); connecting and resetting are retried
(--max-retries, backoff) as they start a fresh session; a step is not (it is not
idempotent), and a failed step is an env error (--env-errors). Before the run, the server's
``/health`` must answer (`check_server`): an unreachable server is a clear error, not a
traceback.

Capacity: an OpenEnv server holds a fixed number of sessions at once (openenv-core's
``max_concurrent_envs``; `openenv init` scaffolds 1) and refuses one more as full (a WebSocket
error, code ``CAPACITY_REACHED``); it publishes the number nowhere else. So the run takes it
from --env-capacity N, or else learns it once, as its first episode starts (`probe_capacity`):
it opens sessions one at a time, up to --concurrency (the most episodes in flight), until the
server refuses one. Every episode then waits for one of that many places (`SessionGate`)
before it opens its session, outside --env-timeout, in short waits that end with the run's
stop, and frees it when it closes; the run says in one line what it found and whether
episodes queue.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import typing
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from grpo.envs.base import EnvError, EnvFactory, StepResult, Task, wait_until
from grpo.plugins import load_callable

__all__ = [
    "OPENENV_PREFIX",
    "Capacity",
    "OpenEnvEpisode",
    "SessionGate",
    "check_server",
    "observation_messages",
    "openenv_factory",
    "parse_env_args",
    "probe_capacity",
]

OPENENV_PREFIX = "openenv:"
INSTALL_HINT = 'pip install -e ".[openenv]" (or pip install openenv-core)'
RESERVED = ("base_url", "action", "observation")
MAX_OBSERVATION_CHARS = 20_000
_SKIPPED_FIELDS = ("done", "reward", "metadata")
CAPACITY_REFUSED = "CAPACITY_REACHED"  # openenv-core's WebSocket error code for a full server
_PROBE_MAX_MESSAGE = 1 << 24

Messages = list[dict[str, str]]


def parse_env_args(env_args: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings -> a dict; ValueError naming --env-arg and the fix."""
    parsed: dict[str, str] = {}
    for item in env_args:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--env-arg {item!r} must look like KEY=VALUE (KEY a Python name)")
        if key.strip() in parsed:
            raise ValueError(f"--env-arg {key.strip()} is given twice; give it once")
        parsed[key.strip()] = value
    return parsed


def _reset_value(value: str) -> Any:
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, int | float | bool) else value


def check_server(base_url: str, timeout_s: float) -> None:
    """ValueError unless an OpenEnv server answers ``GET {base_url}/health`` within timeout_s."""
    url = base_url.rstrip("/") + "/health"
    hint = "start the server, or fix --env-arg base_url=URL (e.g. http://127.0.0.1:8000)"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            raw = answer.read(100_000)
    except urllib.error.HTTPError as error:
        raise ValueError(
            f"--env-arg base_url={base_url}: GET /health answered HTTP {error.code}, so this is "
            f"not an OpenEnv server; {hint}"
        ) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ValueError(
            f"--env-arg base_url={base_url}: no OpenEnv server answers ({reason}); {hint}"
        ) from None
    try:
        json.loads(raw)
    except ValueError:
        raise ValueError(
            f"--env-arg base_url={base_url}: GET /health answered {raw[:80]!r}, not JSON, so "
            f"this is not an OpenEnv server; {hint}"
        ) from None


def _fields(model: Any) -> dict[str, Any]:
    if hasattr(model, "model_dump"):
        values = model.model_dump()
    elif isinstance(model, Mapping):
        values = dict(model)
    else:
        values = dict(vars(model))
    return {key: value for key, value in values.items() if key not in _SKIPPED_FIELDS}


def _bounded_text(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    return text[:MAX_OBSERVATION_CHARS] + f" [... {len(text) - MAX_OBSERVATION_CHARS} characters]"


def observation_messages(observation: Any) -> Messages:
    """The default mapping of an OpenEnv observation to chat messages (module docstring)."""
    fields = _fields(observation)
    messages = fields.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return [{"role": m["role"], "content": _bounded_text(m["content"])} for m in messages]
    texts = [value for value in fields.values() if isinstance(value, str)]
    if len(fields) == 1 and len(texts) == 1:
        return [{"role": "user", "content": _bounded_text(texts[0])}]
    return [{"role": "user", "content": _bounded_text(json.dumps(fields, default=str))}]


def _action_class(client_class: type) -> Any:
    """ActT of ``EnvClient[ActT, ObsT, StateT]`` in the client class's bases, else None."""
    for klass in client_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if getattr(typing.get_origin(base), "__name__", "") == "EnvClient":
                args = typing.get_args(base)
                if args and isinstance(args[0], type):
                    return args[0]
    return None


def text_action(client_class: type, spec: str) -> Callable[[str], Any]:
    """The default text -> action of a client whose action type has one text field."""
    action_class = _action_class(client_class)
    fields = getattr(action_class, "model_fields", None)
    if action_class is None or fields is None:
        raise ValueError(
            f"--env {spec}: cannot tell {client_class.__name__}'s action type; pass "
            "--env-arg action=MODULE:FUNCTION (text -> action)"
        )
    names = [name for name in fields if name != "metadata"]
    text_fields = [name for name in names if fields[name].annotation is str]
    if len(names) != 1 or len(text_fields) != 1:
        raise ValueError(
            f"--env {spec}: the action {action_class.__name__} has fields {names}, not one text "
            "field; pass --env-arg action=MODULE:FUNCTION (text -> action)"
        )
    field = text_fields[0]
    return lambda text: action_class(**{field: text})


def _hook(spec: str, key: str, value: str) -> Callable[..., Any]:
    target, colon, name = value.rpartition(":")
    if not colon or not target or not name.isidentifier():
        raise ValueError(f"--env-arg {key}={value!r} must look like MODULE:FUNCTION")
    return load_callable(f"--env-arg {key}=", value, target, name, namespace="env")


@attrs.frozen
class Capacity:
    """The most sessions the run opens at once on the server (None: no limit was found within
    --concurrency, the most episodes in flight) and the start-of-run line that says so."""

    limit: int | None
    line: str
    given: bool = False  # by --env-capacity


def _sessions(count: int) -> str:
    return f"{count} session{'' if count == 1 else 's'}"


def _queue_line(limit: int, concurrency: int) -> str:
    if limit >= concurrency:
        return f"--concurrency {concurrency} stays within it, so no episode waits"
    return (
        f"of the {concurrency} episodes in flight at most (--concurrency), those beyond {limit} "
        "wait in a queue for a session"
    )


def _refusal(answer: Any) -> dict[str, Any] | None:
    """The data of openenv-core's "server full" error, else None (the session is open)."""
    try:
        message = json.loads(answer)
    except (TypeError, ValueError):
        return None
    if not isinstance(message, dict) or message.get("type") != "error":
        return None
    data = message.get("data")
    return data if isinstance(data, dict) and data.get("code") == CAPACITY_REFUSED else None


def _open_probe_session(url: str, timeout_s: float, held: contextlib.ExitStack) -> Any:
    """One more session, held by `held`: its first answer (to a ``state`` message)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    proxy = None if host in ("localhost", "127.0.0.1", "::1") else True  # as EnvClient does
    socket = held.enter_context(
        connect(
            url,
            open_timeout=timeout_s,
            close_timeout=min(timeout_s, 10.0),
            max_size=_PROBE_MAX_MESSAGE,
            proxy=proxy,
        )
    )
    held.callback(_say_close, socket, timeout_s)
    with contextlib.suppress(ConnectionClosed):  # a refused session is closed at once
        socket.send(json.dumps({"type": "state"}))
    return socket.recv(timeout=timeout_s)  # a refusal is queued before the close: still read


def _say_close(socket: Any, timeout_s: float) -> None:
    """Ask the server to end the session and wait (bounded) until it has: it closes the
    connection only once the session is gone, so the next run's count starts from zero."""
    with contextlib.suppress(Exception):  # the server ends the session either way
        socket.send(json.dumps({"type": "close"}))
    deadline = time.monotonic() + min(timeout_s, 10.0)
    with contextlib.suppress(Exception):  # ConnectionClosed: the session is over
        while time.monotonic() < deadline:
            socket.recv(timeout=max(0.0, deadline - time.monotonic()))


def probe_capacity(base_url: str, concurrency: int, timeout_s: float) -> Capacity:
    """The sessions the server holds at once, learnt by opening them one at a time (each
    asked for its ``state``) until it refuses one as full, at most `concurrency`; all are
    closed before it returns. A refusal names the server's maximum; a session it fails to
    open after others opened counts as a refusal; a server that opens none says nothing."""
    from openenv.core.utils import convert_to_ws_url

    url = convert_to_ws_url(base_url) + "/ws"
    where = f"the OpenEnv server at {base_url}"
    opened = 0
    with contextlib.ExitStack() as held:
        for _ in range(concurrency):
            try:
                refusal = _refusal(_open_probe_session(url, timeout_s, held))
            except Exception as error:  # noqa: BLE001 - a failed open is the answer (see doc)
                if opened == 0:
                    return Capacity(
                        None,
                        f"{where} did not open a first session to count its capacity "
                        f"({type(error).__name__}: {error}); episodes open sessions as they "
                        "run; pass --env-capacity N if it holds fewer than --concurrency "
                        f"{concurrency}",
                    )
                return Capacity(
                    opened,
                    f"{where} holds {_sessions(opened)} at once (it failed to open one more: "
                    f"{type(error).__name__}); {_queue_line(opened, concurrency)}",
                )
            if refusal is not None:
                if opened == 0:
                    return Capacity(
                        1,
                        f"{where} is full ({refusal.get('active_sessions')}/"
                        f"{refusal.get('max_sessions')} sessions taken by other clients); "
                        "episodes take its sessions one at a time as they free up",
                    )
                return Capacity(
                    opened,
                    f"{where} holds {_sessions(opened)} at once (it refused session "
                    f"{opened + 1} as full; max_concurrent_envs={refusal.get('max_sessions')}); "
                    f"{_queue_line(opened, concurrency)}",
                )
            opened += 1
    return Capacity(
        None,
        f"{where} opened all {_sessions(concurrency)} the run holds at most at once "
        f"(--concurrency {concurrency}), so no episode waits",
    )


class SessionGate:
    """The run's places on an OpenEnv server: `acquire` waits for one of `Capacity.limit`
    (learnt by `resolve` on first use, once), `release` frees it."""

    def __init__(self, resolve: Callable[[], Capacity]) -> None:
        self.resolve = resolve
        self.capacity: Capacity | None = None
        self.open = 0
        self._resolving = threading.Lock()
        self._changed = threading.Condition()

    def _learn(self, note: Callable[[str], None]) -> None:
        """`resolve()` once, on a daemon thread (a probe of a server that hangs is bounded by
        its timeouts, and a stopping run does not wait for it); its line logged."""
        where = "learning the OpenEnv server's capacity"
        wait_until(lambda timeout_s: self._resolving.acquire(timeout=timeout_s), where)
        try:
            if self.capacity is not None:
                return
            outcome: list[tuple[bool, Any]] = []
            done = threading.Event()

            def resolve() -> None:
                try:
                    outcome.append((True, self.resolve()))
                except Exception as error:  # noqa: BLE001 - raised on the waiting thread
                    outcome.append((False, error))
                finally:
                    done.set()

            threading.Thread(target=resolve, name="grpo-openenv-probe", daemon=True).start()
            wait_until(done.wait, where)
            ok, value = outcome[0]
            if not ok:
                raise value
            note(value.line)
            with self._changed:
                self.capacity = value
        finally:
            self._resolving.release()

    def _take(self, timeout_s: float) -> bool:
        with self._changed:
            limit = self.capacity.limit if self.capacity is not None else None
            if limit is None or self.open < limit:
                self.open += 1
                return True
            self._changed.wait(timeout_s)
        return False

    def acquire(self, note: Callable[[str], None]) -> None:
        """One place, waited for in short slices (KeyboardInterrupt once the run stops)."""
        if self.capacity is None:
            self._learn(note)
        wait_until(self._take, "an OpenEnv episode's queue for a session")

    def release(self) -> None:
        """Free a place taken by `acquire`."""
        with self._changed:
            self.open -= 1
            self._changed.notify()


def _close_quietly(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - the session is over either way
            pass


class OpenEnvEpisode:
    """One episode: one session of an OpenEnv client (see the module docstring)."""

    def __init__(
        self,
        task: Task,
        make_client: Callable[[], Any],
        *,
        to_action: Callable[[str], Any],
        to_messages: Callable[[Any], Any],
        reset_args: Mapping[str, Any],
        max_retries: int,
        retry_delay_s: float = 1.0,
        gate: SessionGate | None = None,
    ) -> None:
        self.task = task
        self.make_client = make_client
        self.to_action = to_action
        self.to_messages = to_messages
        self.reset_args = dict(reset_args)
        self.max_retries = max_retries
        self.retry_delay_s = retry_delay_s
        self.gate = gate
        self.client: Any = None
        self._placed = False  # holds a place of the gate
        self._ended = False  # closed: a session opened late (an abandoned call) is closed
        self._lock = threading.Lock()

    def wait_for_session(self, note: Callable[[str], None]) -> None:
        """Wait for a place on the server (`SessionGate`), before `initial_observation` and
        outside --env-timeout; the first episode of the run learns the server's capacity."""
        if self.gate is not None and not self._placed:
            self.gate.acquire(note)
            with self._lock:
                self._placed = True
                ended = self._ended
            if ended:
                self.close()

    def _messages(self, observation: Any, where: str) -> Messages:
        messages = self.to_messages(observation)
        if not isinstance(messages, list):
            raise EnvError(f"{where}: the observation hook returned {type(messages).__name__}")
        return messages

    def initial_observation(self) -> Messages:
        """A fresh session, reset (retried); the run's system messages, then the observation."""
        last: Exception | None = None
        client: Any = None
        for attempt in range(self.max_retries + 1):
            self._disconnect()
            try:
                client = self.make_client().sync()
                with self._lock:
                    if self._ended:  # this call was abandoned (--env-timeout) and closed
                        break
                    self.client = client
                client.connect()
                result = client.reset(seed=self.task.index, **self.reset_args)
                break
            except Exception as error:  # noqa: BLE001 - reported below with the server's words
                last = error
                if attempt < self.max_retries:
                    time.sleep(self.retry_delay_s * 2**attempt)
        else:
            capacity = self.gate.capacity if self.gate is not None else None
            self.close()
            raise EnvError(
                f"the OpenEnv server did not open an episode after {self.max_retries + 1} tries "
                f"({type(last).__name__}: {last}); is it running, and is it an OpenEnv server?"
                + (
                    f" Does it hold --env-capacity {capacity.limit} sessions at once? Lower the "
                    "flag, or leave it out for the run to learn the capacity."
                    if capacity is not None and capacity.given
                    else ""
                )
            )
        with self._lock:
            ended = self._ended
        if ended:  # closed meanwhile: this session is no one's, so it ends here
            _close_quietly(client)
            raise EnvError("the episode was closed while its session opened")
        system = [dict(m) for m in self.task.messages if m.get("role") == "system"]
        return [*system, *self._messages(result.observation, "reset()")]

    def step(self, action_text: str) -> StepResult:
        """The action sent, the server's observation, reward (None: 0) and done."""
        if self.client is None:
            raise EnvError("step() before initial_observation(): the episode has no session")
        try:
            result = self.client.step(self.to_action(action_text))
        except Exception as error:  # noqa: BLE001 - a failed step ends the episode
            self.close()
            raise EnvError(
                f"the OpenEnv server's step failed ({type(error).__name__}: {error})"
            ) from None
        try:
            reward = 0.0 if result.reward is None else float(result.reward)
        except (TypeError, ValueError):
            self.close()
            raise EnvError(
                f"the OpenEnv server answered reward {result.reward!r}, not a number"
            ) from None
        done = bool(result.done)
        messages = self._messages(result.observation, "step()") if not done else []
        if done:
            self.close()
        return StepResult(tuple(messages), reward, done)

    def _disconnect(self) -> None:
        with self._lock:
            client, self.client = self.client, None
        _close_quietly(client)

    def close(self) -> None:
        """End the session (best effort) and free its place on the server (idempotent)."""
        with self._lock:
            self._ended = True
        self._disconnect()
        with self._lock:
            placed, self._placed = self._placed, False
        if placed and self.gate is not None:
            self.gate.release()


def openenv_factory(
    spec: str,
    env_args: Sequence[str],
    *,
    timeout_s: float,
    max_retries: int,
    capacity: int | None = None,
    concurrency: int = 1,
) -> EnvFactory:
    """The factory of ``--env openenv:MODULE:CLIENT``; ValueError naming the flag and the fix
    (openenv-core absent, no base_url, a client that is not an OpenEnv client, a server that
    does not answer). Its episodes share one `SessionGate`: `capacity` places (--env-capacity),
    or as many as `probe_capacity` finds within `concurrency` when the first episode starts."""
    body = spec[len(OPENENV_PREFIX) :]
    target, colon, name = body.rpartition(":")
    if not colon or not target.strip() or not name.strip().isidentifier():
        raise ValueError(
            f"--env {spec!r} must look like openenv:MODULE:CLIENT (an OpenEnv EnvClient class)"
        )
    try:
        from openenv.core import EnvClient
    except ImportError:
        raise ValueError(f"--env {spec}: openenv-core is not installed; {INSTALL_HINT}") from None
    args = parse_env_args(env_args)
    base_url = args.pop("base_url", None)
    if not base_url:
        raise ValueError(
            f"--env {spec} needs --env-arg base_url=URL (the OpenEnv server, e.g. "
            "http://127.0.0.1:8000)"
        )
    client_class = load_callable("--env", spec, target.strip(), name.strip(), namespace="env")
    if not (isinstance(client_class, type) and issubclass(client_class, EnvClient)):
        raise ValueError(
            f"--env {spec}: {name} is not an OpenEnv EnvClient class (openenv.core.EnvClient)"
        )
    action_hook = args.pop("action", None)
    observation_hook = args.pop("observation", None)
    to_action = (
        _hook(spec, "action", action_hook) if action_hook else text_action(client_class, spec)
    )
    to_messages = (
        _hook(spec, "observation", observation_hook) if observation_hook else observation_messages
    )
    limit = timeout_s if timeout_s > 0 else 60.0
    check_server(base_url, limit)
    reset_args = {key: _reset_value(value) for key, value in args.items()}

    def make_client() -> Any:
        return client_class(base_url=base_url, connect_timeout_s=limit, message_timeout_s=limit)

    def resolve_capacity() -> Capacity:
        if capacity is None:
            return probe_capacity(base_url, concurrency, limit)
        return Capacity(
            capacity,
            f"the OpenEnv server at {base_url} holds {_sessions(capacity)} at once "
            f"(--env-capacity); {_queue_line(capacity, concurrency)}",
            given=True,
        )

    gate = SessionGate(resolve_capacity)

    def factory(task: Task) -> OpenEnvEpisode:
        return OpenEnvEpisode(
            task,
            make_client,
            to_action=to_action,
            to_messages=to_messages,
            reset_args=reset_args,
            max_retries=max_retries,
            gate=gate,
        )

    return factory
