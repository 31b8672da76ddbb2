"""Run untrusted Python (a model's code) in a subprocess with limits: `run_python`, `run_tests`.

What the sandbox provides everywhere (Linux; other POSIX systems lack some rlimits):

- a fresh temporary working directory, removed afterwards; the program arrives on stdin;
- `python -I` (isolated mode: no user site-packages, no `PYTHON*` variables, no script
  directory on `sys.path`) with an empty environment, so API keys are not passed;
- its own session and process group, killed as a whole (SIGKILL) at the wall-clock timeout;
- rlimits set before exec: CPU seconds, address space, processes (RLIMIT_NPROC), file size,
  open files, and no core dumps;
- stdout and stderr read up to a cap each; past the cap the pipe is closed.

`run_tests` never decides a verdict in the process that runs the solution: that process
gets the solution, the tests' setup statements and the *holes* of each assert (the
expressions that call the solution, `grpo/core/code_checks.py`), never an assert's
expected side; it prints each hole's value as tagged plain data, which is decoded here
(anything else, an object with its own `__eq__` or an `int` subclass, is refused) and
compared here, or, for asserts of other forms, in a second sandboxed run of the tests
that never sees the solution. Patching builtins, `compile` or `print`, rewriting the
harness through `__main__`, reading its markers or exiting early can at most change the
values the solution's calls claim, which is what a solution does anyway.

Where `file_system_isolated()` holds (Linux, as root or with unprivileged user namespaces,
`unshare` installed, x86_64 or aarch64), each run also gets new mount, network and PID
namespaces (and a user namespace when not root) and a minimal root built by
`_BOOTSTRAP` and entered by `pivot_root`, the old root detached:

- a tmpfs of `disk_bytes` (64 MiB) and `disk_files` (4096) for everything it writes
  (`/sandbox`, the working directory, and `/tmp`);
- read-only, nosuid binds of `/usr`, `/bin`, `/sbin`, `/lib*`, `/etc/ld.so.cache`, the
  Python installation behind the running one (never a virtual environment, so no `grpo`
  and no project packages), and `/dev/null`, `zero`, `full`, `random`, `urandom`;
- a fresh `/proc` of its own PID namespace; no `/sys`, no `/etc` but the linker cache, no
  `/home`, no `/root` (but the Python installation where it lives there), no project, run
  or temporary directory of the caller, so no file-system UNIX socket of the host either
  (abstract ones belong to the network namespace, also new); no network, not even loopback;
- as root, the program runs as an unprivileged uid (one of 10**6 from 10**9, chosen
  at random a run) with `no_new_privs`: it cannot remount, unmount, chroot, write the
  binds or join another cgroup, and RLIMIT_NPROC binds it; without root, a second user
  namespace locks the mounts instead.

As root, where a cgroup v1 `pids` hierarchy is writable, a pids cgroup made by this
process caps the processes too (`process_limit_enforced`); the program cannot leave it
(no `/sys`, not root). Where `file_system_isolated()` fails, one warning says so and runs
fall back to `unshare -r -n -p -f -m --mount-proc` (or `-r -n`, or nothing, with one more
warning): then the program sees and may write every file the calling user can, reach its
UNIX sockets, fill its disk a file of `file_bytes` at a time, and, as root, move itself
out of the pids cgroup.

What it never provides: no seccomp filter, no Landlock rule, no memory cgroup (memory is
bounded by RLIMIT_AS only); kernel bugs are out of scope. Run code rewards on a machine
or container you can lose.
"""

from __future__ import annotations

import contextlib
import itertools
import json
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

from grpo.core import code_checks

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
_SANDBOX_UID_BASE = 1_000_000_000
_SANDBOX_UIDS = 1_000_000
_probe_lock = threading.Lock()
_mount_probe_lock = threading.Lock()
_probed: dict[str, tuple[str, ...] | bool] = {}


@attrs.frozen
class SandboxLimits:
    """Limits of one run: wall-clock and CPU seconds, memory, processes, files, output, disk.

    `disk_bytes` and `disk_files` bound everything the run writes, together, where the
    file system is isolated (`file_system_isolated`); `file_bytes` bounds each file always.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 16
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_bytes: int = 1 << 20
    disk_bytes: int = 64 << 20
    disk_files: int = 4096


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


_BOOTSTRAP = r"""
import ctypes, json, os, sys
config = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
def check(status, what):
    if status != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"sandbox setup: {what}: {os.strerror(error)}")
def mount(source, target, kind, flags, data=None):
    encode = lambda text: None if text is None else text.encode()
    check(libc.mount(encode(source), encode(target), encode(kind), flags, encode(data)), target)
root, uid = config["root"], config["uid"]
mount(None, "/", None, REC | PRIVATE)
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, config["tmpfs"])
for source in config["binds"]:
    target = root + source
    if os.path.islink(source) and os.path.dirname(source) == "/":
        os.symlink(os.readlink(source), target)
        continue
    os.makedirs(target if os.path.isdir(source) else os.path.dirname(target), exist_ok=True)
    if not os.path.isdir(source):
        open(target, "w").close()
    mount(source, target, None, BIND | REC)
    device = source.startswith("/dev/")
    mount(None, target, None, REMOUNT | BIND | RDONLY | NOSUID | (0 if device else NODEV))
os.mkdir(root + "/proc")
try:
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
except OSError:
    pass
for directory in ("/sandbox", "/tmp"):
    os.mkdir(root + directory, 0o700)
    os.chown(root + directory, uid, uid)
os.chdir(root)
check(libc.syscall(config["pivot_root"], b".", b"."), "pivot_root")
check(libc.umount2(b".", 2), "detach the old root")
os.chdir("/sandbox")
if config["drop_to_uid"]:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
else:
    check(libc.unshare(0x10000000), "lock the mounts in a new user namespace")
check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
os.execve(config["python"], [config["python"], "-I", "-"], {})
"""
_PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
_BIND_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/lib32",
    "/libx32",
    "/etc/ld.so.cache",
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
)


def _base_python() -> str:
    """The interpreter behind this one, outside any virtual environment (so no `grpo` in it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _binds() -> list[str]:
    """What the minimal root shows, read-only: the system's programs and libraries, Python."""
    paths = [path for path in _BIND_PATHS if os.path.lexists(path)]
    covered = tuple(path + "/" for path in paths)
    for prefix in (sys.base_prefix, sys.base_exec_prefix, str(Path(_base_python()).parent)):
        prefix = os.path.realpath(prefix)
        if not (prefix + "/").startswith(covered) and prefix not in paths and prefix != "/":
            paths.append(prefix)
    return paths


def _mount_command(limits: SandboxLimits, root: str) -> list[str] | None:
    """The bootstrap that builds the minimal root in new namespaces, then runs `python -I -`."""
    unshare = shutil.which("unshare")
    syscall = _PIVOT_ROOT_SYSCALL.get(os.uname().machine)
    if unshare is None or syscall is None:
        return None
    is_root = os.geteuid() == 0
    config = {
        "root": root,
        "uid": _SANDBOX_UID_BASE + secrets.randbelow(_SANDBOX_UIDS) if is_root else 0,
        "drop_to_uid": is_root,
        "tmpfs": f"size={limits.disk_bytes},nr_inodes={limits.disk_files},mode=755",
        "binds": _binds(),
        "pivot_root": syscall,
        "python": _base_python(),
    }
    user = () if is_root else ("-r",)
    return [
        unshare,
        *user,
        "-m",
        "-n",
        "-p",
        "-f",
        "--kill-child",
        _base_python(),
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        json.dumps(config),
    ]


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


_MOUNT_PROBE = "import os\nassert os.getcwd() == '/sandbox' and not os.path.exists('/etc/passwd')\n"


def file_system_isolated() -> bool:
    """Whether runs get the minimal read-only root of the module doc (probed once a process).

    When not, one warning says so: the code then sees the caller's file system.
    """
    # One probe at a time, and every caller waits for its answer: none may run unisolated
    # while the first probe is in flight.
    with _mount_probe_lock:
        if "mount" in _probed:
            return bool(_probed["mount"])
        limits = SandboxLimits(timeout_s=20.0, cpu_s=10)
        result = _run(_MOUNT_PROBE, limits, mount=True)
        works = result.returncode == 0 and not result.timed_out
        _probed["mount"] = works
    if not works:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1][:200]
        logger.warning(
            "sandbox: no mount namespace (%s): model code sees this machine's files, can "
            "write where this user can, reach its UNIX sockets, and fill its disk up to "
            "RLIMIT_FSIZE a file; run code rewards in a container you can lose",
            reason,
        )
    return works


def isolation() -> tuple[str, ...]:
    """The namespace prefix of every run: `unshare` with user, net, PID and mount, less, or none.

    Probed once per process; when no namespace works, one warning is logged. Where
    `file_system_isolated()` holds, runs use the minimal root's bootstrap instead.
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
    return _run(source, limits, mount=file_system_isolated())


def _run(source: str, limits: SandboxLimits, mount: bool) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    command = _mount_command(limits, workdir) if mount else None
    if command is None:
        command = [*isolation(), sys.executable, "-I", "-"]
    try:
        with _pids_cgroup(limits.processes) as cgroup:
            process = subprocess.Popen(
                command,
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


_SOLUTION_SIDE = """\
import json as _json, sys as _sys
{encoder}def {record}(index, thunk, reraise):
    try:
        value = thunk()
    except BaseException as error:
        encoded = ["o", "an exception, " + type(error).__name__]
        _sys.stdout.write("\\n" + {marker!r} + " " + _json.dumps([index, encoded]) + "\\n")
        _sys.stdout.flush()
        if reraise:
            raise
        return None
    encoded = _json.dumps([index, _grpo_plain_(value, 0, [{max_nodes}])])
    _sys.stdout.write("\\n" + {marker!r} + " " + encoded + "\\n")
    _sys.stdout.flush()
    return value
_namespace = {{"__name__": "__main__", {record!r}: {record}}}
exec(compile({solution!r}, "solution.py", "exec"), _namespace)
for _index, _source in enumerate({steps!r}):
    try:
        exec(compile(_source, f"test_{{_index}}.py", "exec"), _namespace)
    except Exception:
        pass
"""

_VERDICT_SIDE = """\
_values = {values}
class _HoleFailed(Exception):
    pass
def {hole}(index):
    if index in _values:
        return _values[index]
    raise _HoleFailed(index)
_namespace = {{"__name__": "__main__", {hole!r}: {hole}}}
_passed = 0
for _index, (_source, _is_assert) in enumerate({steps!r}):
    try:
        exec(compile(_source, f"test_{{_index}}.py", "exec"), _namespace)
    except Exception:
        continue
    _passed += _is_assert
print()
print({marker!r}, _passed, flush=True)
"""


def _hole_values(stdout: str, marker: str) -> dict[int, object]:
    """The plain value of each hole the solution's side printed (the first line of each)."""
    values: dict[int, object] = {}
    refused: set[int] = set()
    prefix = marker + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            index, encoded = json.loads(line[len(prefix) :])
        except (ValueError, TypeError, RecursionError):
            continue
        if not isinstance(index, int) or index in values or index in refused:
            continue
        try:
            values[index] = code_checks.decode_plain(encoded)
        except code_checks.NotPlain:
            refused.add(index)
    return values


def _marked_count(result: SandboxResult, marker: str) -> int | None:
    """The count printed after `marker` on the last such line of a clean exit, else None."""
    if result.returncode != 0 or result.timed_out:
        return None
    for line in reversed(result.stdout.splitlines()):
        head, _, count = line.rpartition(" ")
        if head == marker and count.isdigit():
            return int(count)
    return None


def run_tests(
    solution: str, tests: str | Sequence[str], limits: SandboxLimits = SandboxLimits()
) -> TestsResult:
    """`solution` against `tests`, with the verdict out of the solution's reach.

    The tests split as `grpo.core.code_checks.split_checks` says: one sandboxed run holds
    the solution, the tests' setup statements and each assert's holes (never an assert's
    expected side), and prints each hole's value as plain data; the asserts are then
    decided on those values here (`HOLE == literal` and the like) or, for any other
    assert, by a second sandboxed run of the tests that never sees the solution.
    Statements run in order; one that raises does not stop the next. `passed` counts the
    assert statements that hold; a hole whose call raised, that the run never reached
    (an early exit), or whose value is not plain data fails its statement.
    """
    sources = [tests] if isinstance(tests, str) else list(tests)
    checks = code_checks.split_checks(sources)
    total = sum(check.is_assert for check in checks)
    marker = f"grpo-hole-{secrets.token_hex(16)}"
    solution_side = _SOLUTION_SIDE.format(
        record=code_checks.RECORD_FUNCTION,
        encoder=code_checks.ENCODER_SOURCE,
        marker=marker,
        solution=solution,
        steps=[check.sandbox for check in checks],
        max_nodes=code_checks.MAX_NODES,
    )
    result = run_python(solution_side, limits)
    values = _hole_values(result.stdout, marker)
    asserts = [check for check in checks if check.is_assert]
    if all(check.literal is not None for check in asserts):
        passed = sum(code_checks.literal_verdict(check, values) for check in asserts)
        return TestsResult(passed=passed, total=total, run=result)
    verdict_marker = f"grpo-tests-done-{secrets.token_hex(16)}"
    table = ", ".join(f"{k}: {code_checks.plain_source(v)}" for k, v in values.items())
    verdict_side = _VERDICT_SIDE.format(
        values="{" + table + "}",
        hole=code_checks.HOLE_FUNCTION,
        steps=[(check.harness, check.is_assert) for check in checks],
        marker=verdict_marker,
    )
    verdict = run_python(verdict_side, limits)
    passed = min(_marked_count(verdict, verdict_marker) or 0, total)
    return TestsResult(passed=passed, total=total, run=result)
