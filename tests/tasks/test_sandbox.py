"""grpo.sandbox and the code rewards: right code passes; hostile code fails safely.

Every hostile program below runs with a short wall-clock timeout and 16 processes at most;
each test asserts it ended within its bound and that the next run still works.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import attrs
import pytest

from grpo.cli import main
from grpo.core.rewards import RewardInput
from grpo.rewards import code_tests, code_tests_partial, load_rewards
from grpo.rewards.code_grading import last_python_block, row_tests
from grpo.rewards.scores import score_completions
from grpo.sandbox import (
    SandboxLimits,
    isolation,
    process_limit_enforced,
    run_python,
    run_tests,
)
from grpo.tasks import CODE_TASKS

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, processes=16, output_bytes=4096)
BOUND_S = 8.0
DOUBLE = "def double(x):\n    return 2 * x\n"
DOUBLE_TESTS = ["assert double(2) == 4", "assert double(-1) == -2", "assert double(0) == 0"]


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nDone."


def assert_still_works() -> None:
    assert run_tests(DOUBLE, DOUBLE_TESTS, LIMITS).passed == 3


def test_a_correct_solution_passes_and_a_wrong_one_fails() -> None:
    row = {"tests": DOUBLE_TESTS}
    assert code_tests(fenced(DOUBLE), row) == 1.0
    wrong = "def double(x):\n    return x + 2\n"
    assert code_tests(fenced(wrong), row) == 0.0
    assert code_tests_partial(fenced(wrong), row) == pytest.approx(1 / 3)
    assert code_tests("no code here", row) == 0.0


def test_tests_may_be_one_text_a_list_or_a_json_list() -> None:
    text = "x = double(3)\nassert x == 6\nassert double(1) == 2"
    assert run_tests(DOUBLE, text, LIMITS).passed == 2
    assert row_tests({"tests": json.dumps(DOUBLE_TESTS)}) == DOUBLE_TESTS
    with pytest.raises(ValueError, match="no `tests` column"):
        row_tests({"question": "q"})
    with pytest.raises(ValueError, match="no assert"):
        run_tests(DOUBLE, "x = 1", LIMITS)


def test_the_last_fenced_block_is_the_solution() -> None:
    text = "```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```"
    assert last_python_block(text) == "second = 2\n"
    assert last_python_block("```\nbare = 3\n```") == "bare = 3\n"
    assert last_python_block("```python\nunclosed") is None


def test_an_early_exit_with_status_0_passes_nothing() -> None:
    for exit_early in ("import os\nos._exit(0)\n", "raise SystemExit(0)\n"):
        result = run_tests(exit_early, "assert False", LIMITS)
        assert result.passed == 0


def test_an_infinite_loop_is_killed_at_the_timeout_or_the_cpu_limit() -> None:
    loop = "while True:\n    pass\n"
    # The wall clock first (CPU limit far off): the whole group is killed.
    result = run_python(loop, attrs.evolve(LIMITS, timeout_s=2.0, cpu_s=60))
    assert result.timed_out and result.returncode < 0
    assert result.seconds < BOUND_S
    # The CPU limit first (wall clock far off): the kernel kills it.
    result = run_python(loop, attrs.evolve(LIMITS, timeout_s=60.0, cpu_s=1))
    assert not result.timed_out and result.returncode != 0
    assert result.seconds < BOUND_S
    assert_still_works()


def test_a_fork_bomb_is_bounded_by_the_process_limit() -> None:
    if not process_limit_enforced():
        pytest.skip("running as root without a writable pids cgroup: nothing bounds forks")
    bomb = (
        "import os, time\n"
        "started = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        started += 1\n"
        "except OSError:\n"
        "    print('refused after', started, flush=True)\n"
    )
    result = run_python(bomb, LIMITS)
    assert "refused after" in result.stdout
    assert int(result.stdout.split()[-1]) < LIMITS.processes
    assert result.seconds < BOUND_S
    assert_still_works()


def test_a_memory_hog_fails_with_memory_error() -> None:
    result = run_python("hog = bytearray(4 << 30)\n", LIMITS)
    assert result.returncode != 0 and "MemoryError" in result.stderr
    assert result.seconds < BOUND_S
    assert_still_works()


def test_a_gigabyte_print_is_cut_at_the_output_cap() -> None:
    # 1 GiB in 64 KiB writes (one 1 GiB string would be a MemoryError instead).
    flood = "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * (1 << 16))\n"
    result = run_python(flood, LIMITS)
    assert result.returncode != 0 and "BrokenPipeError" in result.stderr
    assert len(result.stdout) <= LIMITS.output_bytes
    assert result.seconds < BOUND_S
    assert_still_works()


def test_no_network_not_even_loopback() -> None:
    if "-n" not in isolation():
        pytest.skip("no network namespace on this machine (unshare -r -n unavailable)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        connect = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
        )
        result = run_python(connect, LIMITS)
        assert result.returncode != 0 and "OSError" in result.stderr
        with pytest.raises(TimeoutError):
            server.accept()
    lookup = run_python("import socket\nsocket.getaddrinfo('example.com', 80)\n", LIMITS)
    assert lookup.returncode != 0
    assert result.seconds < BOUND_S and lookup.seconds < BOUND_S


def test_writes_land_in_a_removed_directory_and_are_size_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = set(Path("/tmp").glob("grpo-sandbox-*"))
    write = (
        "import os\n"
        "open('escape.txt', 'w').write('x')\n"
        "print(os.getcwd())\n"
        "open('big.bin', 'wb').write(b'x' * (64 << 20))\n"
    )
    result = run_python(write, LIMITS)
    workdir = Path(result.stdout.split()[0])
    assert workdir != tmp_path and not workdir.exists()
    assert not (tmp_path / "escape.txt").exists()
    assert result.returncode != 0  # RLIMIT_FSIZE: SIGXFSZ or "File too large"
    assert set(Path("/tmp").glob("grpo-sandbox-*")) == before
    assert_still_works()


def test_the_parents_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "grpo-test-secret-4d1c"
    monkeypatch.setenv("GRPO_TEST_SECRET", secret)
    probe = f"import os\nassert os.environ.get('GRPO_TEST_SECRET') == {secret!r}\n"
    assert run_python(probe, LIMITS).returncode != 0
    # Python's locale coercion (PEP 538) is the only variable the child starts with.
    only_locale = "import os\nassert set(os.environ) <= {'LC_CTYPE'}, dict(os.environ)\n"
    assert run_python(only_locale, LIMITS).returncode == 0
    if "--mount-proc" in isolation():
        scan = (
            "import glob\n"
            "for path in glob.glob('/proc/[0-9]*/environ'):\n"
            "    try:\n"
            "        data = open(path, 'rb').read()\n"
            "    except OSError:\n"
            "        continue\n"
            f"    assert {secret.encode()!r} not in data, path\n"
        )
        assert run_python(scan, LIMITS).returncode == 0


def test_every_built_in_code_task_is_solved_by_its_reference() -> None:
    rows = [json.loads(line) for line in CODE_TASKS.read_text().splitlines()]
    assert len(rows) >= 30
    for row in rows:
        assert set(row) == {"question", "answer", "tests"}
        assert code_tests(row["answer"], row) == 1.0, row["question"]


def test_grpo_train_on_the_code_tasks_runs_offline(tmp_path: Path) -> None:
    run_dir = tmp_path / "code"
    argv = [
        "train",
        "--dataset",
        str(CODE_TASKS),
        "--gold-rule",
        "whole",
        "--reward",
        "grpo.rewards:code_tests",
        "--question-suffix",
        "",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "16",
        "--swanlab-mode",
        "disabled",
        "--run-dir",
        str(run_dir),
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/code_tests"] == 0.0
    assert os.path.exists(run_dir / "config.json")


def test_code_rewards_from_reward_threads_equal_serial_ones() -> None:
    rows = [json.loads(line) for line in CODE_TASKS.read_text().splitlines()][:6]
    completions = [
        row["answer"] if index % 2 else "```python\npass\n```" for index, row in enumerate(rows)
    ]
    rewards = load_rewards(["grpo.rewards:code_tests", "grpo.rewards:code_tests_partial"])
    items = [
        (completion, row, RewardInput(index, "", 1, 16, "stop", 4))
        for index, (completion, row) in enumerate(zip(completions, rows, strict=True))
    ]
    serial = score_completions(rewards, items, [len(items)], workers=0)
    threaded = score_completions(rewards, items, [len(items)], workers=3)
    assert serial.components_P[0]["code_tests"].tolist() == [0.0, 1.0] * 3
    for name in ("code_tests", "code_tests_partial"):
        assert threaded.components_P[0][name].tolist() == serial.components_P[0][name].tolist()
