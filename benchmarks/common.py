"""Shared benchmark plumbing: timing, torch thread settings, machine description, tables.

Timings are the best of several repeats after a warm-up call: on a shared machine the
minimum is the figure least disturbed by other processes, and every ratio the benchmarks
report divides two figures measured in the same run under the same thread setting.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone

import attrs
import torch

# Captured at import, before any benchmark pins threads: torch's own default for this machine.
DEFAULT_THREADS = torch.get_num_threads()


@attrs.frozen
class Timing:
    """Seconds per call over `repeats` timed calls: the best (minimum) and the median."""

    best_s: float
    median_s: float
    repeats: int

    @property
    def best_ms(self) -> float:
        """The best call in milliseconds."""
        return self.best_s * 1e3


def measure(
    call: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
    setup: Callable[[], object] | None = None,
) -> Timing:
    """Time `call` (after `warmup` untimed calls) `repeats` times, fewer once `budget_s` is spent.

    `setup` runs untimed before every call (e.g. to clear gradients). At least one timed
    call always runs. Garbage collection is paused while timing, as `timeit` does.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        call()
    durations: list[float] = []
    started = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(durations) < repeats:
            if setup is not None:
                setup()
            begin = time.perf_counter()
            call()
            durations.append(time.perf_counter() - begin)
            if budget_s is not None and time.perf_counter() - started > budget_s:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(
        best_s=min(durations), median_s=statistics.median(durations), repeats=len(durations)
    )


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with torch (intra-op) pinned to `count` threads, then restore the setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def thread_settings(quick: bool = False) -> list[tuple[str, int]]:
    """(label, count) for 1 thread and for torch's default (once if the default is 1).

    --quick runs 1 thread only: on shared cores the default count can be ten times slower
    (threads wait for a busy core at every parallel op), which would make CI time erratic.
    """
    settings = [("1 thread", 1)]
    if DEFAULT_THREADS != 1 and not quick:
        settings.append((f"default ({DEFAULT_THREADS} threads)", DEFAULT_THREADS))
    return settings


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS; True if it did.

    By default a freed block of more than ~128 KiB-32 MiB goes back to the kernel, so the
    next temporary of that size takes a page fault per 4 KiB page on first write: on a
    virtual machine that costs more than the arithmetic of a float32 elementwise op. This
    is what `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_` (or jemalloc/tcmalloc) do
    for a whole process; blocks above 32 MiB are always mapped afresh.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trimmed = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        mapped = libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MAX_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        return False
    return bool(trimmed and mapped)


def cpu_model() -> str:
    """The CPU's model name as `lscpu` reports it (or /proc/cpuinfo, or platform)."""
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, timeout=10
        ).stdout
        for line in listing.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_lines() -> list[str]:
    """What the numbers were measured on: CPU, cores, torch, Python, load and date."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return [
        f"machine: {cpu_model()}, {os.cpu_count()} logical cores, "
        f"torch default threads {DEFAULT_THREADS}",
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}",
        f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"load average (1/5/15 min): {load}",
    ]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; every cell is formatted with str()."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def argument_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the `--quick` flag every benchmark takes (CI-sized run, seconds)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="CI-sized run: small sizes, few repeats (seconds)"
    )
    return parser


def print_header(title: str, command: str) -> None:
    """The benchmark's title, the command that reproduces it and the machine description."""
    print(f"## {title}\n")
    print(f"command: `{command}`")
    for line in machine_lines():
        print(line)
    print()


def millis(seconds: float) -> str:
    """Seconds as milliseconds with 3 significant digits."""
    return f"{seconds * 1e3:.3g}"


def ratio(numerator: float, denominator: float) -> str:
    """numerator / denominator with 3 significant digits, and an x."""
    return f"{numerator / denominator:.3g}x"
