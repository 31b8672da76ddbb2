"""`grpo serve` bounds the time a request's headers take: tricklers cannot hold every slot."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from grpo.serve.server import serve_in_thread
from tests.serve.conftest import SERVE_API_KEY
from tests.serve.test_serve_hostile import _request_with_retries


def test_clients_trickling_their_headers_lose_their_slots_within_the_header_timeout(
    tmp_path: Path,
) -> None:
    bounds = {"max_connections": 8, "request_timeout_s": 30.0}
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY, **bounds) as handle:
        handle._server.header_timeout_s = 1.0
        host, port = handle.url.removeprefix("http://").split(":")
        stop = threading.Event()
        tricklers = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]

        def trickle(connection: socket.socket) -> None:
            try:
                connection.sendall(b"GET /api/models HTTP/1.1\r\nHost: x\r\n")
                while not stop.wait(0.3):
                    connection.sendall(b"X")
            except OSError:
                pass  # dropped by the server: the point

        threads = [threading.Thread(target=trickle, args=(c,), daemon=True) for c in tricklers]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.3)
            status, took = _request_with_retries(handle.url, within_s=6)
            assert status == 200 and took < 6, (status, took)
        finally:
            stop.set()
            for connection in tricklers:
                connection.close()
            for thread in threads:
                thread.join(2)


def test_a_port_out_of_range_is_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from grpo.serve.command import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--port", port])
        assert "argument --port:" in capsys.readouterr().err
