"""Deterministic fault injection for `grpo serve`: chosen calls fail with 5xx/429 or are delayed.

A fault names an operation (``sample``, ``forward_backward``, ``get_event``,
``create_sampling_run``, ... or ``*`` for every operation; ``grpo serve --help`` lists them), an
action (an HTTP status, or a delay in seconds) and which calls of that operation it hits:
the first N, every K-th, listed call numbers, or each call with probability p drawn from a
generator seeded by the plan's seed. The same plan and the same sequence of calls always
inject the same faults. A fault fires before the server does any work, so a retried call
finds the server unchanged.

Spec syntax (``--fault``): ``OPERATION:ACTION[:WHEN]`` with ACTION ``500``/``503``/``429``/...
or ``delay=SECONDS`` and WHEN ``first=N`` (default ``first=1``), ``every=K``, ``calls=1,4``
or ``p=0.25``. Example: ``--fault sample:503:first=2 --fault forward_backward:delay=0.5:every=3``.
"""

from __future__ import annotations

import random
import threading

import attrs


@attrs.frozen
class Fault:
    """One rule: the calls of `operation` it selects get HTTP `status` and/or a delay."""

    operation: str
    status: int | None = None
    delay_s: float = 0.0
    first: int = 0
    every: int = 0
    calls: tuple[int, ...] = ()
    probability: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.status is None and self.delay_s <= 0:
            raise ValueError(f"fault on {self.operation!r}: give an HTTP status or a delay > 0")
        if self.status is not None and not (self.status == 429 or 500 <= self.status <= 599):
            raise ValueError(
                f"fault on {self.operation!r}: status {self.status} is not 429 or 5xx; "
                "injected faults are transient by design"
            )
        chosen = [bool(self.first), bool(self.every), bool(self.calls), self.probability > 0]
        if sum(chosen) != 1:
            raise ValueError(
                f"fault on {self.operation!r}: choose exactly one of first=N, every=K, "
                "calls=..., p=..."
            )
        if not 0 <= self.probability <= 1:
            raise ValueError(f"fault on {self.operation!r}: p={self.probability} is not in [0, 1]")

    def selects(self, call_number: int, draw: float) -> bool:
        """Whether call `call_number` (1-based) is hit; `draw` is its uniform random draw."""
        if self.first:
            return call_number <= self.first
        if self.every:
            return call_number % self.every == 0
        if self.calls:
            return call_number in self.calls
        return draw < self.probability


def parse_fault(spec: str) -> Fault:
    """A `Fault` from ``OPERATION:ACTION[:WHEN]`` (see the module docstring)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(
            f"--fault {spec!r}: expected OPERATION:ACTION[:WHEN], e.g. sample:503:first=2"
        )
    operation, action = parts[0], parts[1]
    when = parts[2] if len(parts) == 3 else "first=1"
    fields: dict[str, object] = {"operation": operation}
    try:
        if action.startswith("delay="):
            fields["delay_s"] = float(action.removeprefix("delay="))
        else:
            fields["status"] = int(action)
        key, _, value = when.partition("=")
        if key == "first":
            fields["first"] = int(value)
        elif key == "every":
            fields["every"] = int(value)
        elif key == "calls":
            fields["calls"] = tuple(int(item) for item in value.split(","))
        elif key == "p":
            fields["probability"] = float(value)
        else:
            raise ValueError(f"unknown WHEN {when!r}; use first=N, every=K, calls=1,4 or p=0.25")
        return Fault(**fields)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"--fault {spec!r}: {error}") from None


class FaultPlan:
    """Thread-safe fault decisions: counts calls per operation, records what it injected."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = (), *, seed: int = 0) -> None:
        self.faults = tuple(faults)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self.injected: list[tuple[str, int, str]] = []

    def decide(self, operation: str) -> tuple[int | None, float]:
        """(HTTP status to fail with or None, seconds to delay) for this call of `operation`."""
        if not self.faults:
            return None, 0.0
        with self._lock:
            number = self._calls[operation] = self._calls.get(operation, 0) + 1
            status, delay = None, 0.0
            for fault in self.faults:
                if fault.operation not in (operation, "*"):
                    continue
                draw = self._random.random() if fault.probability > 0 else 0.0
                if not fault.selects(number, draw):
                    continue
                delay += fault.delay_s
                if status is None and fault.status is not None:
                    status = fault.status
            if status is not None or delay > 0:
                what = f"HTTP {status}" if status is not None else f"delay {delay:g}s"
                self.injected.append((operation, number, what))
            return status, delay

    def count(self, operation: str) -> int:
        """How many faults (failures or delays) were injected into `operation` so far."""
        with self._lock:
            return sum(1 for name, _number, _what in self.injected if name == operation)
