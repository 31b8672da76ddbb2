"""The environment API: `Task`, the `Env` protocol, `StepResult`, groups, and `--env` loading.

An environment plays one episode. It opens with chat messages (`initial_observation`), then
answers each action of the policy (the text of one sampled assistant turn) with
`step(action_text)`: the observation messages that follow it, the turn's reward, and whether
the episode is done. A step may return a `StepResult` (which also counts tool calls and tool
errors for the metrics) or a plain ``(messages, reward, done)`` tuple.

`--env MODULE:FACTORY` or `--env path/to/file.py:FACTORY` names a factory called once per
episode with the `Task` (a dataset row, its gold answer and the run's prompt messages):

    def factory(task: Task) -> Env: ...

`make_group` builds the G environments of one task (one per group member, so the episodes
compete under the same task for the group advantage). An environment's text is untrusted
model output: an environment must never execute it (the calculator tool parses it with
`ast`, `grpo/envs/tools.py`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from grpo.core.messages import ROLES
from grpo.core.messages import check_messages as core_check_messages
from grpo.plugins import load_callable

__all__ = [
    "ROLES",
    "Env",
    "EnvError",
    "EnvFactory",
    "EnvTimeout",
    "StepResult",
    "Task",
    "as_step_result",
    "check_messages",
    "env_step",
    "env_tools",
    "initial_messages",
    "load_env_factory",
    "make_group",
    "stop_env_calls_on",
    "wait_until",
]

MAX_REWARD = 1e12  # as grpo.rewards.MAX_REWARD: the largest |reward| of one turn
Message = Mapping[str, str]


class EnvError(ValueError):
    """An environment that broke the protocol: bad messages, a non-finite reward, a crash."""


class EnvTimeout(EnvError):
    """An environment call that did not return within --env-timeout."""


@attrs.frozen
class Task:
    """What one episode is about: the row's question, gold answer, index, columns, and the
    run's prompt messages for it (--system-prompt, few-shot, --question-suffix applied)."""

    question: str
    gold: str
    index: int = 0
    row: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)
    messages: tuple[Mapping[str, str], ...] = ()


@attrs.frozen
class StepResult:
    """The environment's answer to one action: observation messages, reward r_t, done, and
    how many tool calls the action made and how many of them were answered with an error."""

    observation: tuple[Mapping[str, str], ...] = attrs.field(converter=tuple)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Env(Protocol):
    """One episode of an environment (a fresh object per episode)."""

    def initial_observation(self) -> list[dict[str, str]]:
        """The chat messages the episode opens with (the first prompt)."""
        ...

    def step(self, action_text: str) -> StepResult | tuple[list[dict[str, str]], float, bool]:
        """The policy's turn ``action_text`` -> (observation messages, reward, done)."""
        ...


MAX_TOOLS_CHARS = 20_000
"""The longest JSON an env's ``tools`` may take (it is rendered into every prompt)."""


def env_tools(env: object) -> list[dict[str, Any]] | None:
    """The function signatures an env offers (its optional ``tools`` attribute: a list of
    ``{"type": "function", "function": {...}}`` dicts, JSON, at most `MAX_TOOLS_CHARS`),
    which the chat template lists in the system turn; None when it offers none."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    about = f"{_env_name(env)}.tools"
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise EnvError(f"{about} is {type(tools).__name__}, not a list of function signatures")
    if not all(isinstance(tool, Mapping) for tool in tools):
        raise EnvError(f"{about} holds a non-dict; each tool is a {{'type': 'function', ...}} dict")
    try:
        size = len(json.dumps(list(tools)))
    except (TypeError, ValueError) as error:
        raise EnvError(
            f"{about} is not JSON ({error}); give plain dicts, lists and strings"
        ) from None
    if size > MAX_TOOLS_CHARS:
        raise EnvError(f"{about} takes {size} characters as JSON; at most {MAX_TOOLS_CHARS}")
    return [dict(tool) for tool in tools] or None


EnvFactory = Callable[[Task], Env]


def check_messages(messages: object, where: str) -> tuple[dict[str, str], ...]:
    """Messages as a tuple of {"role", "content"} dicts; EnvError naming ``where`` otherwise."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise EnvError(f"{where} returned {type(messages).__name__}, not a list of messages")
    return core_check_messages(messages, where, EnvError)


def as_step_result(value: object, where: str) -> StepResult:
    """An env's step answer (a StepResult or a (messages, reward, done) tuple), checked."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(observation=value[0] or (), reward=value[1], done=value[2])
    else:
        raise EnvError(
            f"{where} returned {type(value).__name__}; return (messages, reward, done) or a "
            "grpo.envs.StepResult"
        )
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvError(f"{where} returned reward {reward!r}; return a finite float")
    if not math.isfinite(float(reward)):
        raise EnvError(f"{where} returned reward {reward!r}; rewards must be finite")
    if abs(float(reward)) > MAX_REWARD:
        raise EnvError(
            f"{where} returned reward {reward!r}, beyond ±{MAX_REWARD:g} (episode returns and "
            "their variances would overflow); scale the reward down"
        )
    if not isinstance(result.done, bool):
        raise EnvError(f"{where} returned done = {result.done!r}; return True or False")
    calls, errors = result.tool_calls, result.tool_errors
    if not (isinstance(calls, int) and isinstance(errors, int) and 0 <= errors <= calls):
        raise EnvError(
            f"{where} returned tool_calls = {calls!r}, tool_errors = {errors!r}; "
            "counts are integers with 0 <= tool_errors <= tool_calls"
        )
    return attrs.evolve(
        result,
        observation=check_messages(result.observation, where),
        reward=float(reward),
    )


_POLL_S = 0.1
_STOP_GRACE_S = 5.0
_stops: set[threading.Event] = set()  # the stop events of the runs in progress here
_stops_lock = threading.Lock()
_EXITING = threading.Event()
# Set when the interpreter starts to exit, before it joins non-daemon threads (such as a
# rollout pool's, which concurrent.futures joins the same way): a wait on a stuck env call
# ends then, so the process can exit. A private hook, hence the guard.
# concurrent.futures registers its join on import; imported first, it runs after this
# hook (the hooks run last registered first).
importlib.import_module("concurrent.futures.thread")
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_EXITING.set)


def _env_name(env: object) -> str:
    return type(env).__qualname__


@contextlib.contextmanager
def stop_env_calls_on(event: threading.Event) -> Iterator[None]:
    """While inside, an env call still running `_STOP_GRACE_S` s after `event` is set ends
    its wait with KeyboardInterrupt (a run's SIGINT/SIGTERM stops it whatever the env does)."""
    with _stops_lock:
        _stops.add(event)
    try:
        yield
    finally:
        with _stops_lock:
            _stops.discard(event)


def _stop_requested() -> bool:
    with _stops_lock:
        return any(event.is_set() for event in _stops)


def wait_until(poll: Callable[[float], bool], where: str) -> None:
    """Return once ``poll(timeout_s)`` (a wait of at most timeout_s s) is True, polling in
    short slices: KeyboardInterrupt when the run is stopping (`stop_env_calls_on`) and it is
    still waiting 5 s later, EnvError naming `where` when the interpreter starts to exit."""
    stopped_at: float | None = None
    while not poll(_POLL_S):
        if stopped_at is None and _stop_requested():
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at > _STOP_GRACE_S:
            raise KeyboardInterrupt
        if _EXITING.is_set() or not threading.main_thread().is_alive():
            raise EnvError(f"{where}: the run stopped while it waited")


def _bounded(fn: Callable[[], Any], where: str, about: str, timeout_s: float) -> Any:
    """`fn()` on a daemon thread, awaited at most `timeout_s` (0: no limit).

    EnvTimeout past it; EnvError for any exception of the call, SystemExit and
    KeyboardInterrupt included (an environment may not end the run); KeyboardInterrupt when
    the run is stopping (`stop_env_calls_on`) and the call has not returned 5 s later. A
    call that never returns is left behind on its daemon thread, so it cannot keep the
    process alive, and the wait also ends when the interpreter starts to exit.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def call() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as error:  # noqa: BLE001 - reported to the run as an EnvError
            outcome.append((False, error))
        finally:
            done.set()

    threading.Thread(target=call, name="grpo-env-call", daemon=True).start()
    deadline = None if timeout_s <= 0 else time.monotonic() + timeout_s
    stopped_at: float | None = None
    while not done.wait(_POLL_S):
        if stopped_at is None and _stop_requested():
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at > _STOP_GRACE_S:
            raise KeyboardInterrupt
        if deadline is not None and time.monotonic() > deadline:
            raise EnvTimeout(
                f"{where} ({about}) did not return within --env-timeout {timeout_s:g}s; make the "
                "environment answer faster (or bound its own waits), or raise --env-timeout"
            )
        if _EXITING.is_set() or not threading.main_thread().is_alive():
            raise EnvError(f"{where} ({about}) was still running when the run stopped")
    ok, value = outcome[0]
    if ok:
        return value
    if isinstance(value, EnvError):
        raise value
    kind = "may not end the run" if not isinstance(value, Exception) else "does not raise"
    raise EnvError(
        f"{where} raised {type(value).__name__}: {value} ({about}); an environment {kind}: "
        "it answers bad actions with an observation"
    ) from value


def initial_messages(env: Env, timeout_s: float = 0.0) -> tuple[dict[str, str], ...]:
    """The env's checked, non-empty opening messages, its call bounded by `timeout_s`."""
    where, about = "initial_observation()", _env_name(env)
    messages = check_messages(_bounded(env.initial_observation, where, about, timeout_s), where)
    if not messages:
        raise EnvError(
            f"{where} of {about} returned no messages; an episode opens with at least one"
        )
    return messages


def env_step(env: Env, action: str, turn: int, timeout_s: float = 0.0) -> StepResult:
    """The env's checked answer to `action`, its call bounded by `timeout_s`."""
    about = f"{_env_name(env)}, turn {turn}"
    return as_step_result(
        _bounded(lambda: env.step(action), "env.step", about, timeout_s), "env.step"
    )


def make_group(factory: EnvFactory, task: Task, group_size: int) -> list[Env]:
    """The G environments of one task: ``factory(task)`` called G times, G distinct objects."""
    envs = [factory(task) for _ in range(group_size)]
    for env in envs:
        if not all(callable(getattr(env, name, None)) for name in ("initial_observation", "step")):
            raise EnvError(
                f"--env factory returned {type(env).__name__}, which has no "
                "initial_observation() and step(action_text); return an Env"
            )
    if len({id(env) for env in envs}) != len(envs):
        raise EnvError(
            "--env factory returned the same object twice for one task; each episode needs its "
            "own environment (build a new one in the factory)"
        )
    return envs


def load_env_factory(spec: str) -> EnvFactory:
    """The factory `--env MODULE:FACTORY` / `FILE.py:FACTORY` names; ValueError naming the fix."""
    example = "e.g. --env grpo.envs:calculator_wordproblems or --env my_env.py:make_env"
    target, colon, name = spec.rpartition(":")
    if not colon or not target.strip() or not name.strip().isidentifier():
        raise ValueError(f"--env {spec!r} must look like MODULE:FACTORY; {example}")
    return load_callable("--env", spec, target.strip(), name.strip(), namespace="env")
