"""pytrio pointed at a `grpo serve` for the clients of a block (tests, notebooks, benchmarks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def configured_pytrio(
    url: str, *, api_key: str, home: str | Path, **options: Any
) -> Iterator[None]:
    """pytrio pointed at `url` (its home at `home`, telemetry off, `options` passed to
    `pytrio.configure`) for clients created inside the block; its settings restored after.

    At exit the block's clients are shut down (their service sessions closed) while the
    server still answers: a pytrio client collected after its server is gone would retry
    closing its session for 15 minutes.
    """
    import gc

    import pytrio
    from pytrio.config import config as pytrio_config
    from pytrio.runtime.service import cancel_active_service_runtimes

    saved = pytrio_config.configuration.model_copy(deep=True)
    auth = pytrio_config.auth_state
    saved_auth = (auth.api_key, auth.config_error)
    pytrio.configure_observability(enabled=False)
    pytrio.configure(home=str(home), base_url=url, api_key=api_key, **options)
    try:
        yield
    finally:
        gc.collect()
        cancel_active_service_runtimes()
        for field in type(saved).model_fields:
            setattr(pytrio_config.configuration, field, getattr(saved, field))
        auth.api_key, auth.config_error = saved_auth
        pytrio.configure_observability(enabled=True)
