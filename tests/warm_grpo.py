"""`grpo` commands as processes of their own, forked from one warm interpreter.

A test that runs many `grpo train` processes (tests/training/test_faults.py kills each one
part way) paid each one's start-up: importing torch, transformers and peft, about 6 s of a
7 s run on two cores. `WarmGrpo` starts one interpreter (`python -m tests.warm_grpo`) that
imports those modules once, with the environment a `grpo` process would have, and forks a
child per command. Each child is a process of its own: it runs the command as
`python -m grpo ARGV` does (`raise SystemExit(grpo.cli.main())` with `sys.argv` set, an
uncaught exception's traceback on stderr, the interpreter's exit hooks run), it can be
signalled and killed by its pid, and its exit status reads as a `subprocess` return code
(-9 for SIGKILL, 130 for an interrupted command). What a child learns from its parent is
only what a fresh process would have imported itself.

The protocol on the warm interpreter's stdin and stdout is one JSON line each way: a request
``{"argv": [...], "cwd": path, "env": {...}, "stdout": path, "stderr": path}`` is answered
``{"pid": N}`` once the child is forked and ``{"returncode": N}`` once it has ended.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]
# What `grpo train` imports on its way to its first step (its start-up).
PRELOAD = ("grpo.cli", "grpo.training.recipes.grpo.run", "grpo.backends.local")
START_TIMEOUT_S = 300.0


def _returncode(status: int) -> int:
    """A `waitpid` status as `subprocess` reports it: -N for signal N, else the exit code."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_command(request: Mapping[str, object]) -> None:
    """In the forked child: run `grpo ARGV` as `python -m grpo` would, then exit."""
    code: int = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, key in ((1, "stdout"), (2, "stderr")):
            target = os.open(str(request[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update(request["env"])  # type: ignore[arg-type]
        sys.argv = ["grpo", *request["argv"]]  # type: ignore[misc]
        code = _main_as_a_script()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - the process ends either way
                pass
        os._exit(code)


def _main_as_a_script() -> int:
    """`raise SystemExit(grpo.cli.main())` and the interpreter's exit: the exit code."""
    import atexit
    import threading
    import traceback

    from grpo.cli import main

    try:
        code = main()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: traceback, exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # joins threads, their exit hooks
    atexit._run_exitfuncs()
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends a script by SIGINT
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _serve() -> None:
    """The warm interpreter: import PRELOAD, then fork a child per request on stdin."""
    import importlib
    import threading

    for module in PRELOAD:
        importlib.import_module(module)
    answers = sys.stdout
    sys.stdout = sys.stderr
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        # A fork copies only the calling thread: with no other thread alive, no lock is
        # left held in the child.
        assert threading.active_count() == 1, threading.enumerate()
        pid = os.fork()
        if pid == 0:
            _run_command(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": _returncode(status)}), file=answers, flush=True)


class WarmGrpo:
    """A warm interpreter that runs `grpo` commands one at a time, each in a forked child."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_grpo"],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.buffer = b""
        self.pid: int | None = None
        assert self._answer(START_TIMEOUT_S) == {"ready": True}

    def __enter__(self) -> WarmGrpo:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the warm interpreter (and a child still running)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.kill()
        self.process.wait()

    def _answer(self, timeout: float) -> dict[str, int]:
        """The next JSON line from the warm interpreter (read unbuffered, so that `select`
        sees every line not yet taken)."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, left))
            assert ready, f"the warm grpo interpreter did not answer in {timeout:.0f} s"
            chunk = os.read(self.process.stdout.fileno(), 4096)
            assert chunk, f"the warm grpo interpreter exited ({self.process.wait()})"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv: Sequence[str], output: Path, env: Mapping[str, str] | None = None) -> int:
        """Start `grpo ARGV` in this directory, with the warm interpreter's environment plus
        `env`, stdout and stderr to OUTPUT.out and OUTPUT.err: its pid."""
        assert self.pid is None, "one command at a time"
        assert self.process.stdin is not None
        request = {
            "argv": list(argv),
            "cwd": os.getcwd(),
            "env": {**self.env, **(env or {})},
            "stdout": f"{output}.out",
            "stderr": f"{output}.err",
        }
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.pid = self._answer(START_TIMEOUT_S)["pid"]
        return self.pid

    def running(self) -> bool:
        """Whether the command started last has not ended yet."""
        assert self.pid is not None and self.process.stdout is not None
        if b"\n" in self.buffer:
            return False
        ended, _, _ = select.select([self.process.stdout], [], [], 0)
        return not ended

    def wait(self, timeout: float) -> int:
        """The running command's return code (as `subprocess` gives it) once it ends."""
        deadline = time.monotonic() + timeout
        try:
            answer = self._answer(max(0.0, deadline - time.monotonic()))
        except AssertionError:
            self.close()
            raise
        self.pid = None
        return answer["returncode"]


if __name__ == "__main__":
    _serve()
