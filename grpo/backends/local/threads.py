"""The local backend's torch thread policy: how many intra-op threads its torch work uses.

All of a local service's torch work (sampling, training, evaluation, a custom loss, and
so `grpo serve` too) runs on its one worker thread; the caller's thread mostly waits on
futures. torch's default gives every thread one intra-op thread per core, and OpenMP
threads that meet at a barrier after every op: once the cores are busy with other work,
each op waits for a descheduled thread and a run slows far below its fair share
(benchmarks/README.md, "Speed under load"). So the policy:

- ``--threads N`` (``threads=N``, N >= 1): the worker runs on N threads.
- ``threads=0`` (auto) when the user set nothing: the worker runs on
  ``auto_threads(parameter_count, cores)`` threads: 1 below ``MANY_PARAMETERS``, every
  core above it. The built-in ~1M-parameter model's ops are small: on idle cores 2
  threads made them 1.3-1.8x faster, on shared cores the whole run 2.3-4.3x slower
  (benchmarks/README.md, "Speed under load"), and shared cores are the common case.
- ``threads=0`` when the user chose a count (``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``
  set, or ``torch.set_num_threads`` called, seen as a count other than torch's default):
  torch's setting is left exactly as it is, on every thread.
- Whenever the policy sets the worker's count, the caller's thread gets the cores the
  worker leaves (at least 1), so the two never ask for more than ``max(cores, N + 1)``.

The count changes speed only: seeded sampling and training metrics are the same on any
thread count (tests/backends/test_local_sampling.py, README).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
import torch

# Below this, ops are too small for several threads to pay for their barriers under load
# (measured on the built-in model only: no larger model is available offline here).
MANY_PARAMETERS = 20_000_000
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# The count this module last set: a fresh thread starts with the last count set anywhere, so
# a later service's worker seeing it must not read it as the user's choice.
_last_applied: int | None = None


@attrs.frozen
class ThreadPlan:
    """Intra-op threads for the worker and for the caller's thread; None leaves torch's count."""

    worker: int | None
    caller: int | None
    reason: str


def check_threads(threads: int) -> int:
    """`threads` if it is a whole number >= 0 (0 = auto); else ValueError naming the fix."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be a whole number >= 0 (0 = auto), got {threads!r}")
    return threads


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def torch_default_threads() -> int:
    """torch's own default intra-op count here: its physical cores (all processors without
    SMT information), as `at::intraop_default_num_threads` counts them."""
    cores: set[tuple[str, str]] = set()
    physical = core = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    physical = value.strip()
                elif key.strip() == "core id":
                    core = value.strip()
                    cores.add((physical, core))
    except OSError:
        pass
    return len(cores) or max(1, os.cpu_count() or 1)


def user_setting(env: Mapping[str, str], current: int, default: int) -> str | None:
    """What the user chose for torch's threads (an env var, or a count other than the
    default), or None when nothing was chosen."""
    for name in THREAD_ENV_VARS:
        if env.get(name, "").strip():
            return f"{name}={env[name]}"
    if current != default:
        return f"torch.set_num_threads({current})"
    return None


def auto_threads(parameter_count: int, cores: int) -> int:
    """1 below MANY_PARAMETERS parameters; `cores` at or above it."""
    return 1 if parameter_count < MANY_PARAMETERS else max(1, cores)


def choose_threads(
    threads: int,
    *,
    parameter_count: int,
    cores: int,
    env: Mapping[str, str],
    current: int,
    default: int,
) -> ThreadPlan:
    """The plan for `threads` (0 = auto): an explicit count wins, then the user's setting,
    then `auto_threads`; the caller gets `max(1, cores - worker)`."""
    check_threads(threads)
    if threads:
        return ThreadPlan(threads, max(1, cores - threads), f"--threads {threads}")
    chosen = user_setting(env, current, default)
    if chosen is not None:
        return ThreadPlan(None, None, f"left as the user set it ({chosen})")
    worker = auto_threads(parameter_count, cores)
    return ThreadPlan(
        worker, max(1, cores - worker), f"auto: {worker} for {parameter_count:,} parameters"
    )


def plan_here(threads: int, parameter_count: int) -> ThreadPlan:
    """`choose_threads` with this process's environment, cores and current torch count."""
    current, default = torch.get_num_threads(), torch_default_threads()
    return choose_threads(
        threads,
        parameter_count=parameter_count,
        cores=available_cores(),
        env=os.environ,
        current=default if current == _last_applied else current,
        default=default,
    )


def set_threads(count: int | None) -> None:
    """Give the calling thread `count` intra-op threads (None: leave them)."""
    global _last_applied
    if count is None:
        return
    _last_applied = count
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
