"""Tinker sessions on `grpo serve` end: a session whose client went silent (no heartbeat, no
request) for the expiry is freed with its training and sampling clients; a live one is not;
a request on the expired one is a 4xx saying to make a new ServiceClient. And a
`--backend tinker` program that exits without closing its client still finishes its session."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from grpo.backends.names import TINY_MODEL_NAME  # noqa: E402
from grpo.serve.server import ServeHandle, serve_in_thread  # noqa: E402
from grpo.serve.tinker_service import TinkerService  # noqa: E402
from grpo.serve.wire import ServeError  # noqa: E402
from tests.serve.conftest import SERVE_API_KEY  # noqa: E402
from tests.serve.test_tinker_sdk import (  # noqa: E402
    TINKER_KEY,
    TOKENS,
    ce_datum,
    close_clients,
    service,
)

EXPIRY_S = 60.0


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked(tmp_path: Path) -> Iterator[tuple[ServeHandle, FakeClock]]:
    """`grpo serve` whose Tinker sessions expire after EXPIRY_S s of a hand-moved clock."""
    with serve_in_thread(
        root=tmp_path / "served", api_key=SERVE_API_KEY, tinker_session_expiry_s=EXPIRY_S
    ) as handle:
        clock = FakeClock()
        handle.state.tinker.clock = clock
        yield handle, clock
        close_clients()


def heartbeat(handle: ServeHandle, session_id: str) -> int:
    """The status of a raw ``session_heartbeat`` for `session_id`."""
    request = urllib.request.Request(
        f"{handle.url}/api/v1/session_heartbeat",
        data=json.dumps({"session_id": session_id}).encode(),
        headers={"X-API-Key": TINKER_KEY, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes
def test_a_silent_session_expires_and_frees_its_clients_while_a_live_one_stays(
    clocked: tuple[ServeHandle, FakeClock],
) -> None:
    handle, clock = clocked
    tinker_state: TinkerService = handle.state.tinker
    dead, live = service(handle), service(handle)
    trainers = {}
    for name, client in (("dead", dead), ("live", live)):
        trainers[name] = client.create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=4, seed=1
        ).result()
    dead_id, live_id = (trainers[name].get_info().model_id for name in ("dead", "live"))
    dead_sampler = trainers["dead"].save_weights_and_get_sampling_client().result()
    freed = weakref.ref(tinker_state.model(dead_id).client)
    dead_session, live_session = dead.holder.get_session_id(), live.holder.get_session_id()

    clock.now += EXPIRY_S - 10  # the live client heartbeats; the dead one is silent
    assert heartbeat(handle, live_session) == 200
    clock.now += 11  # the dead one silent past the expiry, the live one 11 s
    assert tinker_state.expire_silent_sessions() == [dead_session]
    assert tinker_state.find_model(dead_id) is None
    assert tinker_state.find_model(live_id) is not None

    datum = ce_datum(TOKENS, np.ones(len(TOKENS) - 1))
    with pytest.raises(tinker.BadRequestError, match="expired.*make a new ServiceClient"):
        trainers["dead"].forward_backward([datum], "cross_entropy").result()
    params = types.SamplingParams(max_tokens=2, seed=0)
    prompt = types.ModelInput.from_ints(TOKENS)
    with pytest.raises(tinker.BadRequestError, match="make a new ServiceClient"):
        dead_sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    assert heartbeat(handle, dead_session) == 410  # the SDK stops heartbeating on a 410

    # the live session trains on (and its job moves the worker off the dead one's last)
    out = trainers["live"].forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    gc.collect()
    assert freed() is None  # the dead session's trainer (and its adapter) is gone
    # a new ServiceClient is the fix for the dead one
    again = service(handle)
    trainer = again.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4).result()
    assert trainer.forward_backward([datum], "cross_entropy").result().metrics
    again.close("success").result()


def test_the_expiry_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tinker-session-expiry must be > 0"):
        serve_in_thread(root=tmp_path, tinker_session_expiry_s=0)


def test_a_backend_tinker_program_that_exits_without_closing_finishes_its_session(
    tmp_path: Path,
) -> None:
    program = (
        "from grpo.backends.tinker_sdk import make_tinker_service_client\n"
        "service = make_tinker_service_client()\n"
        f"service.create_lora_training_client(base_model={TINY_MODEL_NAME!r}, rank=4, seed=0)\n"
        "print(service.client.holder.get_session_id())\n"
    )
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        env = {**os.environ, "TINKER_BASE_URL": handle.url, "TINKER_API_KEY": TINKER_KEY}
        env.pop("TINKER_TELEMETRY", None)
        done = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        session_id = done.stdout.split()[-1]
        models, _ = handle.state.tinker.session_members(session_id)
        assert models and all(handle.state.tinker.find_model(m) is None for m in models)
        with pytest.raises(ServeError, match="was finished"):
            handle.state.tinker.session(session_id)


def test_a_training_clients_steady_sampling_burst_is_started_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import grpo.serve.tinker_service as service_module
    from grpo.serve.tinker_service import done

    monkeypatch.setattr(service_module, "GATE_MAX_S", 60.0)  # only the count opens the gate
    tinker_state = TinkerService(registry=None, stopping=threading.Event())  # type: ignore[arg-type]
    started: list[str] = []

    def start(name: str) -> Callable[[], Any]:
        return lambda: (started.append(name), done(name.encode(), proto=True))[1]

    for _ in range(2):  # two steps of 3 requests each: the pattern the gate learns
        sampler = tinker_state.add_sampler(None, "m", None, "owner", "model-1")  # type: ignore[arg-type]
        for index in range(3):
            tinker_state.sample_once(None, start(f"early-{index}"), sampler)
    assert len(started) == 6  # ungated: each started at once
    gated = tinker_state.add_sampler(None, "m", None, "owner", "model-1")  # type: ignore[arg-type]
    first: list[str] = []
    waiter = threading.Thread(
        target=lambda: first.append(tinker_state.sample_once(None, start("a"), gated))
    )
    waiter.start()
    while not tinker_state._gates[gated].held:  # the first request is held...
        waiter.join(0.01)
    assert len(started) == 6  # not started yet
    ids = [tinker_state.sample_once(None, start(name), gated) for name in ("b", "c")]
    waiter.join(30)
    assert started[6:] == ["a", "b", "c"]  # ...until the burst is whole, then in order
    results = [tinker_state.poll(request_id, 5)[0].future.result() for request_id in first + ids]
    assert results == [b"a", b"b", b"c"]
    tinker_state.sample_once(None, start("d"), gated)  # past the burst: at once
    assert started[-1] == "d"


def test_a_closed_server_hangs_up_on_a_kept_alive_connection_and_frees_its_state(
    tmp_path: Path,
) -> None:
    """A client that keeps its connection open past the server's close (the SDK's pyqwest
    pool does, until the program exits) gets no answer on it, and its connection's thread
    holds none of the server's state: freed there at the interpreter's exit, the trainers'
    tensors would abort the process."""
    import http.client

    handle = serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY)
    host, port = handle.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"X-API-Key": TINKER_KEY}
    connection.request("GET", "/api/v1/healthz", headers=headers)
    assert connection.getresponse().read() == b'{"status": "ok"}'  # kept alive
    state = weakref.ref(handle.state.tinker)
    handle.close()
    del handle
    gc.collect()
    assert state() is None  # the connection's thread, still serving it, holds none of it
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        connection.request("GET", "/api/v1/healthz", headers=headers)
        connection.getresponse()
    connection.close()
