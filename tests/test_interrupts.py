"""Ctrl-C stops long commands within seconds, also on a loaded machine (`grpo/interrupts.py`)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future

from grpo.interrupts import request_result

STOP_BOUND_S = 10.0
"""Generous for a loaded 2-core machine; before the fix `grpo eval` went on sampling every
queued problem of the seed (30 s and more under load)."""


def _lines_of(process: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output lines as they come (None at its end), read on a daemon thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue[str | None], text: str, timeout_s: float) -> list[str]:
    """Every line read until one containing `text` (fails at the end of output or timeout)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        assert line is not None, f"ended before {text!r}: {''.join(seen)}"
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no line with {text!r} within {timeout_s}s: {''.join(seen)}")


def test_sigint_stops_a_long_eval_within_seconds() -> None:
    # 200 problems x 256 samples: about half a minute of sampling on 2 idle cores.
    command = [sys.executable, "-m", "grpo", "eval", "--limit", "200", "--samples", "256"]
    command += ["--temperature", "1.0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        lines = _lines_of(process)
        _wait_for_line(lines, "256 sample(s) x 1 seed(s)", timeout_s=180)
        time.sleep(1.0)  # sampling is under way (the line is printed just before it starts)
        assert process.poll() is None, "finished before the signal: give it more work"
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            process.wait(timeout=120)
        finally:
            took = time.monotonic() - sent
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "".join(rest)
    assert process.returncode == 130, output
    assert "grpo eval: interrupted" in output
    assert "Traceback" not in output, output
    assert took < STOP_BOUND_S, f"stopped {took:.1f}s after SIGINT"


def test_a_thread_waiting_on_a_request_does_not_hold_the_process_at_exit() -> None:
    script = textwrap.dedent(
        """
        import threading
        from concurrent.futures import Future
        from grpo.interrupts import dropping_pool, request_result

        never: Future = Future()  # a request the backend never answers
        pool_cm = dropping_pool(1, "waiting")
        pool = pool_cm.__enter__()
        pool.submit(request_result, never)
        print("waiting", flush=True)
        """
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    # Before (a plain .result()): the interpreter joined the pool's thread for ever.
    assert done.returncode == 0 and "waiting" in done.stdout, done.stderr
    assert time.monotonic() - began < 30


def test_request_result_passes_on_the_requests_own_outcome() -> None:
    answered: Future[int] = Future()
    answered.set_result(3)
    assert request_result(answered) == 3
    failed: Future[int] = Future()
    failed.set_exception(TimeoutError("the service timed out"))
    try:
        request_result(failed)
    except TimeoutError as error:
        assert "the service timed out" in str(error)
    else:
        raise AssertionError("the request's own TimeoutError was swallowed")
