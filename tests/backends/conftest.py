"""Fixtures for the backend tests: `grpo serve` on a free loopback port, an isolated pytrio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SERVE_API_KEY = "test-serve-key"


@pytest.fixture
def pytrio_home(tmp_path: Path) -> Iterator[Path]:
    """pytrio with its home in tmp_path, telemetry off and fast retries; restored afterwards."""
    import pytrio
    from pytrio.config import config as pytrio_config

    saved = pytrio_config.configuration.model_copy(deep=True)
    saved_key, saved_error = pytrio_config.auth_state.api_key, pytrio_config.auth_state.config_error
    home = tmp_path / "pytrio-home"
    home.mkdir()
    pytrio.configure_observability(enabled=False)
    pytrio.configure(home=str(home), retry_initial_delay_seconds=0.02, retry_max_delay_seconds=0.1)
    try:
        yield home
    finally:
        for field in type(saved).model_fields:
            setattr(pytrio_config.configuration, field, getattr(saved, field))
        pytrio_config.auth_state.api_key = saved_key
        pytrio_config.auth_state.config_error = saved_error
        pytrio.configure_observability(enabled=True)


@pytest.fixture
def served(tmp_path: Path, pytrio_home: Path) -> Iterator[object]:
    """A `grpo serve` on a free loopback port (API key required) that pytrio points at."""
    import pytrio

    from grpo.backends.serve import serve_in_thread

    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        pytrio.configure(base_url=handle.url, api_key=SERVE_API_KEY)
        yield handle
