"""The fault-injection hook: named points where the fault suite may signal the run.

`tests/training/test_faults.py` sets ``GRPO_FAULT_POINT`` to stop a real run at a chosen place
(after sampling, after an optimizer step, before a row is logged, in the middle of a
checkpoint save, before an evaluation) and checks that the resumed run equals an uninterrupted one
(docs/RELIABILITY.md). Unset, a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "GRPO_FAULT_POINT"
"""Fault injection for tests: ``<point>:<n>:<SIGNAL>`` sends SIGNAL to this process at the
n-th pass (from 1) of the named point, e.g. ``save:2:SIGKILL``. Unset, it costs one lookup."""

_fault_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    """A named place where the fault-injection suite may signal the run (see FAULT_ENV)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, count, signal_name = spec.split(":")
    if point != name:
        return
    _fault_passes[name] = _fault_passes.get(name, 0) + 1
    if _fault_passes[name] == int(count):
        for _ in range(2 if signal_name == "SIGINT2" else 1):
            os.kill(os.getpid(), getattr(signal, signal_name.rstrip("2")))
