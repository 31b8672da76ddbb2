"""A client that resets a keep-alive connection between requests (``SO_LINGER`` 0, a TCP RST)
ends that connection quietly: no traceback on the server's stderr, and it keeps serving."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from grpo.serve.server import serve_in_thread

RESETS = 3


def _get_then_reset(host: str, port: int) -> bytes:
    """``GET /`` on a keep-alive connection, the whole reply read, then a reset (an RST)."""
    connection = socket.create_connection((host, port), timeout=10)
    connection.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: keep-alive\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += connection.recv(4096)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += connection.recv(4096)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()
    return head.split(b"\r\n")[0]


def _connection_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("Thread-"))


def test_a_reset_idle_connection_leaves_no_traceback_and_the_server_serves_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with serve_in_thread(root=tmp_path / "served") as handle:
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        before = _connection_threads()
        statuses = [_get_then_reset(host, int(port)) for _ in range(RESETS)]
        deadline = time.monotonic() + 10
        while _connection_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)  # each connection's thread reads the reset, then ends
        assert _connection_threads() <= before, "a reset connection's thread did not end"
        assert statuses == [b"HTTP/1.1 200 OK"] * RESETS
        assert _get_then_reset(host, int(port)) == b"HTTP/1.1 200 OK"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err[-2000:]
