"""A small OpenEnv environment of the tests: sums served over WebSocket on 127.0.0.1.

`SumsEnvironment` (server side, openenv-core's `Environment`): ``reset(seed)`` asks "What is
a + b?" with a and b drawn from the seed; ``step(SumsAction(message=...))`` scores 1.0 when
the message's last ``\\boxed{}`` is a + b, else 0.0, and ends the episode.
`SumsClient` (client side, an `EnvClient`) is what ``--env openenv:tests.envs.openenv_sums:
SumsClient`` names; `serve` runs the server on a free port in a thread until its context
exits.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from grpo.core.rewards import grade


class SumsAction(Action):
    """The policy's answer: one text field."""

    message: str


class SumsObservation(Observation):
    """The question (one text field; done and reward are the base class's)."""

    prompt: str


class SumsEnvironment(Environment):
    """One session's environment: one question per reset, one answer per episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._gold = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
        """A question drawn from ``seed``; ``top`` (a reset argument) bounds the terms."""
        rng = random.Random(seed)
        top = int(kwargs.get("top", 9))
        a, b = rng.randint(0, top), rng.randint(0, top)
        self._gold = str(a + b)
        self._state = State(episode_id=episode_id, step_count=0)
        return SumsObservation(prompt=f"What is {a} + {b}? Put the answer in \\boxed{{}}.")

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Graded once; the episode ends."""
        self._state.step_count += 1
        reward = grade(action.message, self._gold)
        return SumsObservation(prompt="", reward=reward, done=True)

    @property
    def state(self) -> State:
        """The session's state."""
        return self._state


class SumsClient(EnvClient[SumsAction, SumsObservation, State]):
    """The client `--env openenv:tests.envs.openenv_sums:SumsClient` drives."""

    def _step_payload(self, action: SumsAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[SumsObservation]:
        observation = SumsObservation(**payload.get("observation", {}))
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=payload.get("done", False)
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def serve(timeout_s: float = 20.0, app: Any = None) -> Iterator[str]:
    """The sums server (or `app`) on 127.0.0.1 (a free port) in a thread; yields its URL, stops
    on exit."""
    if app is None:
        app = create_fastapi_app(
            SumsEnvironment, SumsAction, SumsObservation, max_concurrent_envs=64
        )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openenv-sums", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the OpenEnv test server did not start within {timeout_s:g}s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)


def answer_action(text: str) -> SumsAction:
    """An --env-arg action= hook: the text as the answer, stripped."""
    return SumsAction(message=text.strip())


def quiz_messages(observation: SumsObservation) -> list[dict[str, str]]:
    """An --env-arg observation= hook: a system line, then the question."""
    return [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": observation.prompt},
    ]
