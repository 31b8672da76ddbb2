"""A code reward the code under test cannot forge, and a sandbox it cannot leave.

Each forging test is a wrong solution plus an attack on the harness that made it score
1.0 when the solution and the asserts shared one process; each must now pass nothing,
while the honest solution next to it still passes. The escape tests need the minimal
root of `file_system_isolated` and skip where this machine cannot give it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from grpo.core import code_checks
from grpo.rewards import code_tests
from grpo.sandbox import (
    SandboxLimits,
    file_system_isolated,
    process_limit_enforced,
    run_python,
    run_tests,
)
from grpo.tasks import CODE_TASKS

LIMITS = SandboxLimits(timeout_s=4.0, cpu_s=3, processes=16, output_bytes=1 << 16)
DOUBLE = "def double(x):\n    return 2 * x\n"
WRONG = "def double(x):\n    return None\n"
TESTS = ["assert double(2) == 4", "assert double(-1) == -2", "assert double(0) == 0"]

FORGERIES = {
    "replace the check list through __main__": (
        "import __main__\n"
        "for name in list(vars(__main__)):\n"
        "    value = vars(__main__)[name]\n"
        "    if isinstance(value, list) and value and isinstance(value[0], tuple):\n"
        "        value[:] = [('pass', True)] * len(value)\n"
        "    if isinstance(value, list) and value and isinstance(value[0], str):\n"
        "        value[:] = ['pass'] * len(value)\n"
    ),
    "compile every assert to pass": (
        "import builtins\n"
        "_compile = builtins.compile\n"
        "def compile(source, *args, **kwargs):\n"
        "    if isinstance(source, str) and ('assert' in source or 'record' in source):\n"
        "        source = 'pass'\n"
        "    return _compile(source, *args, **kwargs)\n"
        "builtins.compile = compile\n"
    ),
    "forge the result line through print": (
        "import builtins, sys\n"
        "def print(*args, **kwargs):\n"
        "    if args and isinstance(args[0], str) and args[0].startswith('grpo-'):\n"
        "        args = (args[0], 3)\n"
        "    sys.stdout.write(' '.join(map(str, args)) + '\\n')\n"
        "builtins.print = print\n"
    ),
    "read the marker from the harness frame and exit 0": (
        "import os, sys\n"
        "frame = sys._getframe(0)\n"
        "while frame is not None:\n"
        "    for constant in frame.f_code.co_consts:\n"
        "        if isinstance(constant, str) and constant.startswith('grpo-'):\n"
        "            sys.stdout.write(f'\\n{constant} 3\\n')\n"
        '            sys.stdout.write(f\'\\n{constant} [0, ["i", "4"]]\\n\')\n'
        "    frame = frame.f_back\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    ),
    "an object equal to everything": (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = object.__hash__\n"
        "def double(x):\n"
        "    return Anything()\n"
    ),
    "an int subclass equal to everything": (
        "class Anything(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "def double(x):\n"
        "    return Anything(0)\n"
    ),
    "patch the builtins the assert uses": (
        "import builtins\nbuiltins.abs = lambda value: 0\nbuiltins.sorted = lambda value: [1, 4]\n"
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_wrong_solution_with_an_attack_on_the_harness_passes_nothing(name: str) -> None:
    attack = FORGERIES[name]
    general = [
        *TESTS,
        "assert abs(double(1) - 2) < 1e-9",
        "assert sorted([double(2), 1]) == [1, 4]",
    ]
    for tests in (TESTS, general):
        wrong = run_tests(WRONG + attack, tests, LIMITS)
        assert wrong.passed == 0, (name, wrong.run.stdout[-300:], wrong.run.stderr[-300:])
        assert run_tests(DOUBLE, tests, LIMITS).passed == len(tests)


def test_a_forged_record_line_only_claims_a_value_that_is_then_checked() -> None:
    # Printing the record of a wrong value is no more than returning it.
    forged = (
        "import sys\n"
        "frame = sys._getframe(0)\n"
        "marker = next(c for c in frame.f_code.co_consts if isinstance(c, str) and "
        "c.startswith('grpo-hole-'))\n"
        "for index in range(3):\n"
        '    print(marker, f\'[{index}, ["i", "7"]]\')\n'
        "def double(x):\n"
        "    return None\n"
    )
    assert run_tests(forged, TESTS, LIMITS).passed == 0


def test_the_tests_expected_values_never_reach_the_solutions_process() -> None:
    dump = (
        "import gc, sys\n"
        "seen = []\n"
        "frame = sys._getframe(0)\n"
        "while frame is not None:\n"
        "    seen += [repr(c) for c in frame.f_code.co_consts]\n"
        "    seen += [repr(v) for v in frame.f_globals.values()]\n"
        "    frame = frame.f_back\n"
        "seen += [repr(o) for o in gc.get_objects() if isinstance(o, (str, list, tuple))]\n"
        # Counts, not the matches themselves: printing every repr holding '77' (memory
        # addresses too) overran the sandbox's output cap now and then (a broken pipe). The
        # needles are joined at run time, after `seen`, so the program's own constants
        # cannot match them.
        "hole, leaks = ''.join(['fizz', '(3)']), (''.join(['77', '31']), ''.join(['55', '19']))\n"
        "print('holes seen:', any(hole in s for s in seen))\n"
        "print('leaks seen:', sum(any(leak in s for leak in leaks) for s in seen))\n"
        "def fizz(n):\n"
        "    return None\n"
    )
    tests = ["assert fizz(3) == 'Fizz-expected-7731'", "assert fizz(5) != 'Buzz-unequal-5519'"]
    result = run_tests(dump, tests, LIMITS)
    assert result.passed == 1  # None != 'Buzz-...' holds; the equality does not
    assert "holes seen: True" in result.run.stdout  # the dump ran and saw the holes
    assert "leaks seen: 0" in result.run.stdout  # the expected values were nowhere in it


def test_no_built_in_task_passes_a_none_or_forging_solution() -> None:
    rows = [json.loads(line) for line in CODE_TASKS.read_text().splitlines()]
    for row in rows[:8]:
        name = row["answer"].split("def ", 1)[1].split("(", 1)[0]
        for attack in (
            FORGERIES["an object equal to everything"],
            FORGERIES["compile every assert to pass"],
        ):
            cheat = attack.replace("double", name) + f"\ndef {name}(*args):\n    return None\n"
            if "Anything()" in attack:
                cheat = attack.replace("double", name)
            assert code_tests(f"```python\n{cheat}```", row) == 0.0, row["question"]


def test_plain_data_decoding_refuses_what_is_not_plain() -> None:
    assert code_checks.decode_plain(["t", [["i", "1"], "a", None, ["f", "nan"]]])[:3] == (
        1,
        "a",
        None,
    )
    assert code_checks.decode_plain(["d", [[["t", [["i", "1"]]], ["s", [True]]]]]) == {(1,): {True}}
    for bad in (
        ["o", "Anything"],
        3,
        ["i", "1e5"],
        ["i", "9" * 5000],
        ["s", [["l", []]]],
        ["x", 1],
    ):
        with pytest.raises(code_checks.NotPlain):
            code_checks.decode_plain(bad)
    deep: object = "leaf"
    for _ in range(100):
        deep = ["l", [deep]]
    with pytest.raises(code_checks.NotPlain, match="deeper"):
        code_checks.decode_plain(deep)
    value = {"k": [1, 2.5, float("inf"), (b"x",), frozenset({3}), set()], 4: None}
    assert eval(code_checks.plain_source(value)) == value


def test_a_test_calling_the_solution_inside_a_comprehension_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="a name bound inside the statement"):
        run_tests(DOUBLE, "assert all(double(i) == 2 * i for i in range(3))", LIMITS)
    with pytest.raises(ValueError, match="no assert"):
        run_tests(DOUBLE, "x = double(3)", LIMITS)


def test_setup_statements_and_derived_names_still_work() -> None:
    tests = "xs = [3, 1]\ny = double(xs[0])\nassert y == 6\nassert y + double(xs[1]) == 8\n"
    assert run_tests(DOUBLE, tests, LIMITS).passed == 2
    assert run_tests(WRONG, tests, LIMITS).passed == 0
    stack = (
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n"
    )
    tests = "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.pop() == 1\n"
    assert run_tests(stack, tests, LIMITS).passed == 2


needs_isolation = pytest.mark.skipif(
    not file_system_isolated(), reason="no mount namespace here: the file system is shared"
)


@needs_isolation
def test_the_project_the_home_directories_and_secrets_are_hidden(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("{}\n")
    probe = (
        "import os\n"
        "try:\n    import grpo\n    print('IMPORTED', grpo.__file__)\n"
        "except ImportError:\n    pass\n"
        f"for path in ({str(CODE_TASKS)!r}, '/etc/shadow', '/etc/passwd', {str(metrics)!r}):\n"
        "    try:\n        open(path, 'a').close()\n        print('OPENED', path)\n"
        "    except OSError:\n        pass\n"
        "    try:\n        open(path).read()\n        print('READ', path)\n"
        "    except OSError:\n        pass\n"
        "import sys\n"
        "for home in ('/root', '/home', '/work', '/etc', '/var', '/sys'):\n"
        "    for top, dirs, files in os.walk(home):\n"
        "        if top == sys.base_prefix:\n"
        "            break\n"
        "        on_path = lambda d: sys.base_prefix.startswith(os.path.join(top, d))\n"
        "        others = [d for d in dirs if not on_path(d)]\n"
        "        if set(files) - {'ld.so.cache'} or others:\n"
        "            print('SEES', top, others, files[:3])\n"
        "        dirs[:] = [d for d in dirs if sys.base_prefix.startswith(os.path.join(top, d))]\n"
        "print('done', os.getcwd())\n"
    )
    result = run_python(probe, LIMITS)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.split() == ["done", "/sandbox"], result.stdout[-500:]
    assert metrics.read_text() == "{}\n"


@needs_isolation
def test_the_minimal_root_cannot_be_remounted_or_left() -> None:
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.umount2(b'/usr', 2) != 0\n"
        "assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0\n"
        "for attempt in (lambda: os.setuid(0), lambda: os.chroot('/usr'),\n"
        "                lambda: open('/usr/escape', 'w'), lambda: os.mkdir('/escape')):\n"
        "    try:\n        attempt()\n        print('ESCAPED', attempt)\n"
        "    except OSError:\n        pass\n"
        "print('held')\n"
    )
    result = run_python(probe, LIMITS)
    assert result.returncode == 0 and result.stdout.split() == ["held"], (
        result.stdout + result.stderr
    )


@needs_isolation
def test_the_disk_is_bounded_in_total_not_only_per_file() -> None:
    fill = (
        "total = 0\n"
        "try:\n"
        "    for index in range(128):\n"
        "        with open(f'/sandbox/f{index}', 'wb') as file:\n"
        "            for _ in range(8):\n"
        "                file.write(b'x' * (1 << 20))\n"
        "                total += 1 << 20\n"
        "except OSError as error:\n"
        "    print('stopped', error.errno, total)\n"
    )
    limits = SandboxLimits(timeout_s=10.0, cpu_s=8, disk_bytes=32 << 20)
    result = run_python(fill, limits)
    words = result.stdout.split()
    assert words[:1] == ["stopped"], result.stdout + result.stderr[-300:]
    assert int(words[-1]) <= limits.disk_bytes
    assert result.seconds < 10


@needs_isolation
def test_no_unix_socket_of_the_host_is_reachable(tmp_path: Path) -> None:
    path = tmp_path / "host.sock"
    accepted: list[bytes] = []
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as abstract:
        server.bind(str(path))
        abstract.bind("\0grpo-test-abstract-socket")
        for listener in (server, abstract):
            listener.listen(1)
            listener.settimeout(0.5)
        probe = (
            "import socket\n"
            f"for address in ({str(path)!r}, '\\0grpo-test-abstract-socket'):\n"
            "    client = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        client.connect(address)\n        client.sendall(b'leak')\n"
            "        print('CONNECTED', repr(address))\n"
            "    except OSError:\n        pass\n"
            "print('held')\n"
        )
        result = run_python(probe, LIMITS)

        def accept(listener: socket.socket) -> None:
            try:
                connection, _ = listener.accept()
                accepted.append(connection.recv(16))
            except OSError:
                pass

        threads = [threading.Thread(target=accept, args=(s,)) for s in (server, abstract)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2)
    assert result.stdout.split() == ["held"], result.stdout + result.stderr
    assert accepted == []


@needs_isolation
def test_the_pids_cgroup_cannot_be_left() -> None:
    if not process_limit_enforced():
        pytest.skip("nothing bounds forks here")
    escape = (
        "import glob, os, time\n"
        "for path in glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True) + "
        "['/sys/fs/cgroup/pids/cgroup.procs', '/proc/self/cgroup']:\n"
        "    try:\n        open(path, 'w').write(str(os.getpid()))\n        print('MOVED', path)\n"
        "    except OSError:\n        pass\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(64):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        started += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print('started', started, flush=True)\n"
    )
    result = run_python(escape, LIMITS)
    words = result.stdout.split()
    assert "MOVED" not in words and words[:1] == ["started"], result.stdout + result.stderr
    assert int(words[-1]) < LIMITS.processes
    assert os.path.exists("/proc/self")  # the host's /proc is untouched


def test_a_standard_module_the_tests_use_unimported_is_imported_outside_too() -> None:
    tests = ["assert math.isclose(f(1), 2.0)"]
    honest = "import math\ndef f(x):\n    return 2.0 * x\n"
    patched = "import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 5\n"
    assert run_tests(honest, tests, LIMITS).passed == 1
    assert run_tests(patched, tests, LIMITS).passed == 0
