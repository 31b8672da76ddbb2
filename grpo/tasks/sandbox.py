"""Run untrusted Python (a model's code) in a subprocess with limits: `run_python`, `run_tests`.

What the sandbox provides everywhere (Linux; other POSIX systems lack some rlimits):

- a fresh temporary working directory, removed afterwards; the program arrives on stdin,
  so no file of the harness is left for it to read;
- `python -I` (the running interpreter, isolated mode: no user site-packages, no
  `PYTHON*` variables, no script directory on `sys.path`) with an empty environment, so the
  parent's environment variables (API keys) are not passed;
- its own session and process group, killed as a whole (SIGKILL) at the wall-clock timeout;
- rlimits set before exec: CPU seconds, address space, processes (RLIMIT_NPROC), file size,
  open files, and no core dumps;
- stdout and stderr read up to a cap each; past the cap the pipe is closed, so a program
  printing without end dies of a broken pipe instead of filling memory.

Where `unshare -r -n -p -f -m --mount-proc` works (Linux with unprivileged user namespaces,
or root), the program also runs in its own user, network, PID and mount namespaces: no
network at all (not even loopback: a connect to 127.0.0.1 fails), a `/proc` that shows only
its own processes (so not the environment of others), and every process it starts dies
with it (a child that calls `setsid` cannot outlive the run). Where only `unshare -r -n`
works, it has the network namespace alone; where neither does, `isolation` logs one warning
and code runs with the caller's network and PID space. RLIMIT_NPROC binds no process of
root, so when running as root the process count is bounded by a pids cgroup instead, where
a cgroup v1 `pids` hierarchy is writable (`/sys/fs/cgroup/pids`); `process_limit_enforced`
says whether a fork bomb is bounded on this machine.

What it does not provide: this is not a security boundary against a determined attacker.
There is no seccomp filter, no Landlock rule and no chroot: the program can read every
file the calling user can read, and write wherever that user can write outside the working
directory (its relative paths land in the working directory, which is removed; absolute
paths such as `/tmp/x` or the caller's own files are not protected, only capped in size by
RLIMIT_FSIZE). Without the PID and mount namespaces, `/proc/<pid>/environ` of the user's
other processes stays readable. The pass marker of `run_tests` defeats a program that exits
early with status 0, not one that inspects the harness's frames. Run rewards of this kind
on a machine or container you can lose.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import attrs

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "TestsResult",
    "isolation",
    "process_limit_enforced",
    "run_python",
    "run_tests",
]

logger = logging.getLogger(__name__)

_PIDS_CGROUP_ROOT = Path("/sys/fs/cgroup/pids")
_READ_CHUNK = 65536
_cgroup_names = itertools.count()
_probe_lock = threading.Lock()
_probed: dict[str, tuple[str, ...] | bool] = {}


@attrs.frozen
class SandboxLimits:
    """Limits of one run: wall-clock and CPU seconds, memory, processes, files, output."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 16
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_bytes: int = 1 << 20


@attrs.frozen
class SandboxResult:
    """How a run ended: exit status (negative: killed by that signal), capped output, timeout."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


@attrs.frozen
class TestsResult:
    """Assert statements of a test run that passed, of how many (`passed` is 0 unless it ran)."""

    passed: int
    total: int
    run: SandboxResult


def _runs(command: Sequence[str]) -> bool:
    try:
        result = subprocess.run(
            [*command, sys.executable, "-I", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={},
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def isolation() -> tuple[str, ...]:
    """The namespace prefix of every run: `unshare` with user, net, PID and mount, less, or none.

    Probed once per process; when no namespace works, one warning is logged.
    """
    with _probe_lock:
        if "prefix" not in _probed:
            unshare = shutil.which("unshare")
            candidates = (
                (
                    (unshare, "-r", "-n", "-p", "-f", "-m", "--mount-proc", "--kill-child"),
                    (unshare, "-r", "-n"),
                )
                if unshare
                else ()
            )
            prefix = next((command for command in candidates if _runs(command)), ())
            if not prefix:
                logger.warning(
                    "sandbox: `unshare -r -n` is unavailable (%s); code runs with the "
                    "network and PID space of this process, limited by rlimits only",
                    "not installed" if unshare is None else "user namespaces not permitted",
                )
            _probed["prefix"] = prefix
        prefix = _probed["prefix"]
    assert isinstance(prefix, tuple)
    return prefix


def _cgroups_available() -> bool:
    with _probe_lock:
        if "cgroup" not in _probed:
            _probed["cgroup"] = os.geteuid() == 0 and os.access(_PIDS_CGROUP_ROOT, os.W_OK)
        return bool(_probed["cgroup"])


def process_limit_enforced() -> bool:
    """Whether `SandboxLimits.processes` binds here: RLIMIT_NPROC (not root) or a pids cgroup."""
    return os.geteuid() != 0 or _cgroups_available()


@contextlib.contextmanager
def _pids_cgroup(limit: int) -> Iterator[Path | None]:
    """A fresh pids cgroup capped at `limit` (None when unavailable); its processes die after."""
    if not _cgroups_available():
        yield None
        return
    path = _PIDS_CGROUP_ROOT / f"grpo-sandbox-{os.getpid()}-{next(_cgroup_names)}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(limit))
    except OSError as error:
        logger.warning("sandbox: cannot create pids cgroup %s (%s)", path, error)
        with contextlib.suppress(OSError):
            path.rmdir()
        yield None
        return
    try:
        yield path
    finally:
        deadline = time.monotonic() + 5
        while True:
            with contextlib.suppress(OSError, ValueError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    logger.warning("sandbox: pids cgroup %s could not be removed", path)
                    break
                time.sleep(0.01)


def _limit_child(limits: SandboxLimits, cgroup: Path | None) -> None:
    """In the child before exec: join the cgroup, set every rlimit."""
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    for kind, value in (
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        hard = resource.getrlimit(kind)[1]
        # An unprivileged process may lower its hard limits but never raise them.
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def _read_capped(stream: IO[bytes], cap: int, into: list[bytes]) -> None:
    """Read at most `cap` bytes of `stream` into `into`, then close it (the writer gets EPIPE)."""
    size = 0
    try:
        while size < cap:
            chunk = os.read(stream.fileno(), min(_READ_CHUNK, cap - size))
            if not chunk:
                break
            into.append(chunk)
            size += len(chunk)
    finally:
        stream.close()


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `source` by `python -I` in the sandbox of the module doc; its failures are results."""
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    try:
        with _pids_cgroup(limits.processes) as cgroup:
            process = subprocess.Popen(
                [*isolation(), sys.executable, "-I", "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={},
                start_new_session=True,
                preexec_fn=lambda: _limit_child(limits, cgroup),
            )
            outputs: tuple[list[bytes], list[bytes]] = ([], [])
            readers = [
                threading.Thread(
                    target=_read_capped, args=(stream, limits.output_bytes, chunks), daemon=True
                )
                for stream, chunks in zip((process.stdout, process.stderr), outputs, strict=True)
            ]
            for reader in readers:
                reader.start()
            with contextlib.suppress(BrokenPipeError):
                assert process.stdin is not None
                process.stdin.write(source.encode("utf-8", errors="replace"))
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
            timed_out = False
            try:
                process.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # The whole group, also after a normal exit: children it left running die too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            for reader in readers:
                reader.join(timeout=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stdout, stderr = (b"".join(chunks).decode("utf-8", errors="replace") for chunks in outputs)
    return SandboxResult(
        returncode=process.returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        seconds=time.monotonic() - start,
    )


_HARNESS = """\
_checks = {checks!r}
_namespace = {{"__name__": "__main__"}}
exec(compile({solution!r}, "solution.py", "exec"), _namespace)
_passed = 0
for _index, (_source, _is_assert) in enumerate(_checks):
    try:
        exec(compile(_source, f"test_{{_index}}.py", "exec"), _namespace)
    except Exception:
        continue
    _passed += _is_assert
print()
print({marker!r}, _passed, flush=True)
"""


def _checks(tests: str | Sequence[str]) -> list[tuple[str, bool]]:
    """Each top-level statement of the tests with whether it is an `assert`; ValueError if none."""
    sources = [tests] if isinstance(tests, str) else list(tests)
    checks = []
    for source in sources:
        if not isinstance(source, str):
            raise ValueError(
                f"a test is {source!r} ({type(source).__name__}); expected Python text"
            )
        try:
            module = ast.parse(source)
        except SyntaxError as error:
            raise ValueError(f"test {source[:80]!r} is not valid Python: {error}") from None
        for statement in module.body:
            segment = ast.get_source_segment(source, statement)
            assert segment is not None
            checks.append((segment, isinstance(statement, ast.Assert)))
    if not any(is_assert for _, is_assert in checks):
        raise ValueError(f"tests {sources!r} hold no assert statement")
    return checks


def run_tests(
    solution: str, tests: str | Sequence[str], limits: SandboxLimits = SandboxLimits()
) -> TestsResult:
    """`solution`, then each top-level statement of `tests` in its namespace, in the sandbox.

    Statements run in order; one that raises does not stop the next. `passed` counts the
    assert statements that did not raise, and only when the run printed the random pass
    marker after the last one and exited 0 (a solution that exits early passes nothing).
    """
    checks = _checks(tests)
    total = sum(is_assert for _, is_assert in checks)
    marker = f"grpo-tests-done-{secrets.token_hex(16)}"
    result = run_python(_HARNESS.format(checks=checks, solution=solution, marker=marker), limits)
    passed = 0
    if result.returncode == 0 and not result.timed_out:
        for line in reversed(result.stdout.splitlines()):
            head, _, count = line.rpartition(" ")
            if head == marker and count.isdigit():
                passed = min(int(count), total)
                break
    return TestsResult(passed=passed, total=total, run=result)
