"""Fixtures for the backend tests: `grpo serve` on a free loopback port, an isolated pytrio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SERVE_API_KEY = "test-serve-key"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[object]:
    """A `grpo serve` on a free loopback port (API key required) that pytrio points at.

    pytrio's home is in tmp_path, telemetry is off and its retries are fast; its settings
    are restored afterwards.
    """
    from grpo.serve.client import configured_pytrio
    from grpo.serve.server import serve_in_thread

    home = tmp_path / "pytrio-home"
    home.mkdir()
    with (
        serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle,
        configured_pytrio(
            handle.url,
            api_key=SERVE_API_KEY,
            home=home,
            retry_initial_delay_seconds=0.02,
            retry_max_delay_seconds=0.1,
        ),
    ):
        yield handle


@pytest.fixture
def pytrio_home(tmp_path: Path) -> Iterator[Path]:
    """pytrio with its home in tmp_path and no service behind its base URL yet."""
    from grpo.serve.client import configured_pytrio

    home = tmp_path / "pytrio-home"
    home.mkdir()
    with configured_pytrio("http://127.0.0.1:9", api_key="unused", home=home):
        yield home
