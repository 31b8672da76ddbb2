"""What a local service and all its clients share: the worker, loaded models, seeds, root.

``Engine`` owns the one worker thread every torch call runs on, the base models loaded
so far (one ``ModelHost`` each, loaded on first use), the service's seeded generator and
the checkpoint root.
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
    ) -> None:
        self.root = root
        self.kernel_metrics = kernel_metrics
        self.sampler_dtype = sampler_dtype
        self.worker = Worker(name=f"grpo-local-{uuid.uuid4().hex[:6]}")
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._hosts: dict[str, ModelHost] = {}
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
        return self._hosts[key]

    def run(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the worker and wait for it."""
        return self.worker.call(function).result()
