"""Shared test configuration: hypothesis profiles, torch threading, the warm `grpo`."""

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from grpo.training.run.faults import FAULT_ENV
from tests.warm_grpo import WarmGrpo

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# Two shared cores: one thread keeps small ops fast and results reproducible.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def warm_grpo() -> Iterator[WarmGrpo]:
    """`grpo` commands as processes of their own forked from one warm interpreter (no torch
    start-up each; tests/warm_grpo.py), in this environment with OMP_NUM_THREADS=1 and no
    fault point; a command's own variables go with it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)
    with WarmGrpo(env) as warm:
        yield warm
