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
"""

from __future__ import annotations

import json
import time
import typing
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.envs.base import EnvError, EnvFactory, StepResult, Task
from grpo.plugins import load_callable

__all__ = [
    "OPENENV_PREFIX",
    "OpenEnvEpisode",
    "check_server",
    "observation_messages",
    "openenv_factory",
    "parse_env_args",
]

OPENENV_PREFIX = "openenv:"
INSTALL_HINT = 'pip install -e ".[openenv]" (or pip install openenv-core)'
RESERVED = ("base_url", "action", "observation")
MAX_OBSERVATION_CHARS = 20_000
_SKIPPED_FIELDS = ("done", "reward", "metadata")

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
    ) -> None:
        self.task = task
        self.make_client = make_client
        self.to_action = to_action
        self.to_messages = to_messages
        self.reset_args = dict(reset_args)
        self.max_retries = max_retries
        self.retry_delay_s = retry_delay_s
        self.client: Any = None

    def _messages(self, observation: Any, where: str) -> Messages:
        messages = self.to_messages(observation)
        if not isinstance(messages, list):
            raise EnvError(f"{where}: the observation hook returned {type(messages).__name__}")
        return messages

    def initial_observation(self) -> Messages:
        """A fresh session, reset (retried); the run's system messages, then the observation."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            self.close()
            try:
                self.client = self.make_client().sync()
                self.client.connect()
                result = self.client.reset(seed=self.task.index, **self.reset_args)
                break
            except Exception as error:  # noqa: BLE001 - reported below with the server's words
                last = error
                if attempt < self.max_retries:
                    time.sleep(self.retry_delay_s * 2**attempt)
        else:
            self.close()
            raise EnvError(
                f"the OpenEnv server did not open an episode after {self.max_retries + 1} tries "
                f"({type(last).__name__}: {last}); is it running, and is it an OpenEnv server?"
            )
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

    def close(self) -> None:
        """End the session (best effort)."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the session is over either way
                pass


def openenv_factory(
    spec: str, env_args: Sequence[str], *, timeout_s: float, max_retries: int
) -> EnvFactory:
    """The factory of ``--env openenv:MODULE:CLIENT``; ValueError naming the flag and the fix
    (openenv-core absent, no base_url, a client that is not an OpenEnv client, a server that
    does not answer)."""
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

    def factory(task: Task) -> OpenEnvEpisode:
        return OpenEnvEpisode(
            task,
            make_client,
            to_action=to_action,
            to_messages=to_messages,
            reset_args=reset_args,
            max_retries=max_retries,
        )

    return factory
