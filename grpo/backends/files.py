"""Durable writes: the one fsync helper of the run directory (`grpo.training.run.run_files`) and the
local backend's checkpoints (`grpo.backends.local.checkpoint`).

It lives among the backends because a backend may import only `grpo.core` and
`grpo.backends` (docs/DESIGN.md), and the core does no I/O.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush ``path`` to disk: a file's contents, or a directory's entries (a rename or a new
    file in it), so they survive a crash.

    An ``OSError`` (the path cannot be opened or synced) propagates: a write that cannot be
    made durable is never reported as done.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
