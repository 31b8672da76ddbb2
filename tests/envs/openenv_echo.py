"""The environment `openenv init` scaffolds (openenv-core 0.3.0's echo template), for tests.

`EchoEnvironment` echoes each message (reward: 0.1 per character; never done), its `reset`
takes no seed; `echo_app` is the template's ``create_app(..., max_concurrent_envs=1)``;
`EchoEnv` is the template's client (``--env openenv:tests.envs.openenv_echo:EchoEnv``).
`counted_echo_app` serves the same environment and counts, server-side, the sessions it holds
at once and the ones it refuses as full (`SessionCounts`). Serve either with
`tests.envs.openenv_sums.serve(app=...)` (uvicorn on 127.0.0.1, a free port).
"""

from __future__ import annotations

import threading
from typing import Any
from uuid import uuid4

import attrs
from fastapi import FastAPI
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.exceptions import SessionCapacityError
from openenv.core.env_server.http_server import HTTPEnvServer, create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    """Action for the Echo environment - just a message to echo."""

    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    """Observation from the Echo environment - the echoed message."""

    echoed_message: str = Field(default="", description="The echoed message")
    message_length: int = Field(default=0, description="Length of the echoed message")


class EchoEnvironment(Environment):
    """A simple echo environment that echoes back messages (the template's)."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._reset_count = 0

    def reset(self) -> EchoObservation:  # type: ignore[override]
        """A ready message."""
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._reset_count += 1
        return EchoObservation(
            echoed_message="Echo environment ready!", message_length=0, done=False, reward=0.0
        )

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        """The message echoed; reward 0.1 per character; never done."""
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message,
            message_length=len(message),
            done=False,
            reward=len(message) * 0.1,
            metadata={"original_message": message, "step": self._state.step_count},
        )

    @property
    def state(self) -> State:
        """The current state."""
        return self._state


class EchoEnv(EnvClient[EchoAction, EchoObservation, State]):
    """Client for the Echo environment (the template's)."""

    def _step_payload(self, action: EchoAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[EchoObservation]:
        obs_data = payload.get("observation", {})
        observation = EchoObservation(
            echoed_message=obs_data.get("echoed_message", ""),
            message_length=obs_data.get("message_length", 0),
            done=payload.get("done", False),
            reward=payload.get("reward"),
            metadata=obs_data.get("metadata", {}),
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=payload.get("done", False)
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))


def echo_app(max_concurrent_envs: int = 1) -> FastAPI:
    """The template's ``server/app.py`` app."""
    return create_app(
        EchoEnvironment,
        EchoAction,
        EchoObservation,
        env_name="echo",
        max_concurrent_envs=max_concurrent_envs,
    )


@attrs.define
class SessionCounts:
    """What a counted server saw: sessions held now, the most held at once, refusals."""

    held: int = 0
    peak: int = 0
    refused: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class _CountingServer(HTTPEnvServer):
    """openenv-core's server, counting its WebSocket sessions as it opens and ends them."""

    def __init__(self, counts: SessionCounts, **kwargs: Any) -> None:
        super().__init__(EchoEnvironment, EchoAction, EchoObservation, **kwargs)
        self.counts = counts

    async def _create_session(self) -> Any:
        try:
            opened = await super()._create_session()
        except SessionCapacityError:
            with self.counts.lock:
                self.counts.refused += 1
            raise
        with self.counts.lock:
            self.counts.held += 1
            self.counts.peak = max(self.counts.peak, self.counts.held)
        return opened

    async def _destroy_session(self, session_id: str) -> None:
        with self.counts.lock:
            self.counts.held -= 1
        await super()._destroy_session(session_id)


def counted_echo_app(max_concurrent_envs: int, counts: SessionCounts) -> FastAPI:
    """The echo environment served with `max_concurrent_envs`, its sessions counted."""
    app = FastAPI()
    _CountingServer(counts, max_concurrent_envs=max_concurrent_envs).register_routes(app)
    return app
