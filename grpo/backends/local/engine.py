"""What a local service and all its clients share: the worker, loaded models, seeds, root.

``Engine`` owns the one worker thread every torch call runs on, the base models loaded
so far (one ``ModelHost`` each, loaded on first use), the service's seeded generator, the
checkpoint root and the thread policy (``threads.py``): each load sizes the worker's and
the caller's intra-op threads to the largest model loaded.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.backends.local import threads as thread_policy
from grpo.backends.local.model import ModelHost, load_host
from grpo.backends.local.tiny import MODEL_DIRS
from grpo.backends.local.worker import Worker


class Engine:
    """What a service and all its clients share: the worker, loaded models, seeds, root."""

    def __init__(
        self,
        root: Path,
        seed: int,
        kernel_metrics: bool,
        sampler_dtype: torch.dtype = torch.float32,
        threads: int = 0,
    ) -> None:
        self.root = root
        self.threads = thread_policy.check_threads(threads)
        self.thread_plan: thread_policy.ThreadPlan | None = None
        self.kernel_metrics = kernel_metrics
        self.sampler_dtype = sampler_dtype
        self.worker = Worker(name=f"grpo-local-{uuid.uuid4().hex[:6]}")
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._hosts: dict[str, ModelHost] = {}
        self._parameter_counts: dict[str, int] = {}
        weakref.finalize(self, self.worker.close)

    def draw_seed(self) -> int:
        """The next seed from the service's seeded generator (thread-safe)."""
        with self._rng_lock:
            return int(self._rng.integers(0, 2**31 - 1))

    def host(self, base_model: str) -> ModelHost:
        """The loaded base model (loaded on first use); call on the worker."""
        key = (
            base_model if base_model in MODEL_DIRS else str(Path(base_model).expanduser().resolve())
        )
        if key not in self._hosts:
            self._hosts[key] = load_host(base_model)
            # Counted before any adapter attaches: the base model's weights set the op sizes.
            self._parameter_counts[key] = sum(
                parameter.numel() for parameter in self._hosts[key].model.parameters()
            )
            largest = max(self._parameter_counts.values())
            self.thread_plan = thread_policy.plan_here(self.threads, largest)
            thread_policy.set_threads(self.thread_plan.worker)
        return self._hosts[key]

    def load(self, base_model: str) -> ModelHost:
        """`host(base_model)` run on the worker; the calling thread then takes the plan's
        caller count, so the worker and the caller share the cores."""
        host = self.run(lambda: self.host(base_model))
        assert self.thread_plan is not None
        thread_policy.set_threads(self.thread_plan.caller)
        return host

    def run(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the worker and wait for it."""
        return self.worker.call(function).result()
