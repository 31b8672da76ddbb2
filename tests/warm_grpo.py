"""`grpo` commands as processes of their own, forked from one warm interpreter.

A test that runs many `grpo` processes (tests/training/test_faults.py kills each one part
way; the docs' snippets run a dozen commands) paid each one's start-up: importing torch,
transformers and peft, about 5 s of a 7 s run on two cores. A warm interpreter
(`python -m tests.warm_grpo`) imports those modules once (PRELOAD), with the environment a
`grpo` process would have, and forks a child per command. Each child is a process of its
own: it runs the command as `python -m grpo ARGV` does (`raise SystemExit(grpo.cli.main())`
with `sys.argv` set, an uncaught exception's traceback on stderr, the interpreter's exit
hooks run), it can be signalled and killed by its pid, and its exit status reads as a
`subprocess` return code (-9 for SIGKILL, 130 for an interrupted command). What a child has
from its parent is only what a fresh process would have imported itself.

- `WarmGrpo` (the conftest fixture `warm_grpo`): one command at a time, its stdout and
  stderr to files. A request is one JSON line on the warm interpreter's stdin
  (``{"mode": "grpo", "argv": [...], "cwd": path, "env": {...}, "stdout": path,
  "stderr": path}``), answered on its stdout by ``{"pid": N}`` once the child is forked and
  ``{"returncode": N}`` once it has ended.
- `warm_commands` (the docs' snippets): a `grpo` and a `warm-python SCRIPT` command on PATH
  that pass their own stdin, stdout and stderr to a child of the warm interpreter over a
  Unix socket, relay the signals they get to it and exit as it did; any number at a time.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# What `grpo train` imports on its way to its first step (its start-up).
PRELOAD = ("grpo.cli", "grpo.training.recipes.grpo.run", "grpo.backends.local")
START_TIMEOUT_S = 300.0


def _returncode(status: int) -> int:
    """A `waitpid` status as `subprocess` reports it: -N for signal N, else the exit code."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_command(request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the forked child: with `fds` as its stdin, stdout and stderr, run the request's
    command as its own interpreter would, then exit with its status."""
    code: int = 1
    try:
        for fd, source in enumerate(fds):
            os.dup2(source, fd)
        for source in set(fds) - {0, 1, 2}:
            os.close(source)
        for number in request.get("ignored_signals", ()):
            signal.signal(number, signal.SIG_IGN)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _as_a_script(request["mode"], request["argv"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - the process ends either way
                pass
        os._exit(code)


def _as_a_script(mode: str, argv: Sequence[str]) -> int:
    """`grpo ARGV` (mode "grpo": `raise SystemExit(grpo.cli.main())`) or `python ARGV`
    (mode "python": ARGV[0] a script, run as `__main__`), then the interpreter's exit: the
    exit code."""
    import atexit
    import runpy
    import threading
    import traceback

    from grpo.cli import main

    try:
        if mode == "grpo":
            sys.argv = ["grpo", *argv]
            code = main()
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
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


def _preload() -> None:
    """Import PRELOAD, and check that no thread runs (a fork copies only the calling thread:
    with no other thread alive, no lock is left held in the child)."""
    import importlib
    import threading

    for module in PRELOAD:
        importlib.import_module(module)
    assert threading.active_count() == 1, threading.enumerate()


def _serve_pipe() -> None:
    """The warm interpreter of `WarmGrpo`: a request per line on stdin, answers on stdout,
    one command at a time (its output to the request's files)."""
    _preload()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print cannot garble the answers
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _run_command(request, [null, out, err])
        for fd in (null, out, err):
            os.close(fd)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": _returncode(status)}), file=answers, flush=True)


def _serve_socket(path: str) -> None:
    """The warm interpreter of `warm_commands`: a connection per command on the Unix socket
    `path` (the caller's stdin, stdout and stderr passed with it), any number at a time. A
    runner forked per connection forks the command, answers its pid, waits for it and
    answers its return code."""
    # `-m` put the working directory first on the path; a `grpo` command has its own folder
    # there, which holds no module, and a python script its script's folder.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the runners are reaped as they end
    print(json.dumps({"ready": True}), flush=True)
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in ready:  # stdin at its end: the test that started this one is gone
            os.killpg(0, signal.SIGKILL)  # this group: itself, its runners, their commands
        connection, _ = server.accept()
        if os.fork() != 0:
            connection.close()
            continue
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _, fds, _, _ = socket.recv_fds(connection, 1, 3)
        with connection.makefile("rb") as lines:
            request = json.loads(lines.readline())
        pid = os.fork()
        if pid == 0:
            connection.close()
            _run_command(request, fds)
        for fd in fds:
            os.close(fd)
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        connection.sendall(json.dumps({"returncode": _returncode(status)}).encode() + b"\n")
        os._exit(0)


# A `grpo` (or `warm-python SCRIPT`) on PATH that runs its command in a child of the warm
# interpreter listening on SOCKET, its own stdin, stdout and stderr passed along, the
# signals it gets relayed to the command, and that exits as the command did. Standard
# library only, no site (-S): it starts in milliseconds.
CLIENT = """#!{python} -S
import json, os, signal, socket, sys

IGNORABLE = (signal.SIGINT, signal.SIGQUIT)
ignored = [int(s) for s in IGNORABLE if signal.getsignal(s) == signal.SIG_IGN]
request = {{"mode": {mode!r}, "argv": sys.argv[1:], "cwd": os.getcwd(),
           "env": dict(os.environ), "ignored_signals": ignored}}
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect({socket!r})
socket.send_fds(connection, [b"F"], [0, 1, 2])
connection.sendall(json.dumps(request).encode() + b"\\n")
answers = connection.makefile("rb")
pid = json.loads(answers.readline())["pid"]


def relay(number, _frame):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


# Every signal goes on, also one this process inherited as ignored: the command starts with
# it ignored too, and takes it where it sets a handler of its own (as `grpo serve` does).
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(number, relay)
code = json.loads(answers.readline())["returncode"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


@contextmanager
def warm_commands(bin_dir: Path, cwd: Path, env: Mapping[str, str]) -> Iterator[Path]:
    """A warm interpreter started in `cwd` with `env`, and `bin_dir` made to hold a `grpo`
    command and a `warm-python SCRIPT` command that run in its children (put it first on
    PATH). Everything it started is killed on leaving."""
    bin_dir.mkdir()
    socket_dir = tempfile.mkdtemp(prefix="grpo-warm-")  # short: a socket's path has 107 bytes
    path = os.path.join(socket_dir, "socket")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.warm_grpo", "--socket", path],
        cwd=cwd,
        env={
            **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        },
        stdin=subprocess.PIPE,  # held open while the test runs; its end stops the server
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
        assert ready and json.loads(process.stdout.readline()) == {"ready": True}
        for mode, name in (("grpo", "grpo"), ("python", "warm-python")):
            command = bin_dir / name
            command.write_text(CLIENT.format(python=sys.executable, mode=mode, socket=path))
            command.chmod(0o755)
        yield bin_dir
    finally:
        try:  # the warm interpreter, its runners and every command they forked
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)


class Finished(NamedTuple):
    """How a command ended: its return code (as `subprocess` gives it), stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


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
            "mode": "grpo",
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
        """The running command's return code (as `subprocess` gives it) once it ends; past
        `timeout` seconds it is killed and the wait fails."""
        assert self.pid is not None, "no command is running"
        try:
            answer = self._answer(timeout)
        except AssertionError:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._answer(START_TIMEOUT_S)
            self.pid = None
            raise AssertionError(f"the grpo command ran past {timeout:.0f} s (killed)") from None
        self.pid = None
        return answer["returncode"]

    def run(
        self,
        argv: Sequence[str],
        output: Path,
        env: Mapping[str, str] | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> Finished:
        """`start` then `wait`: how the command ended, with its stdout and stderr."""
        self.start(argv, output, env)
        returncode = self.wait(timeout)
        stdout, stderr = (
            Path(f"{output}.{end}").read_text(encoding="utf-8") for end in ("out", "err")
        )
        return Finished(returncode, stdout, stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--socket"]:
        _serve_socket(sys.argv[2])
    else:
        _serve_pipe()
