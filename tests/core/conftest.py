"""Fixtures of the core tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from grpo.core import compiled_losses


@pytest.fixture(scope="module")
def uncompiled_fused_forms() -> Iterator[None]:
    """The kernels' fused forms run uncompiled: the same math, fast on hypothesis' many shapes.

    ``tests/core/test_fused_losses.py`` checks the compiled forms against the eager kernels.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_losses, "_compiled_form", lambda form: form)
        yield
