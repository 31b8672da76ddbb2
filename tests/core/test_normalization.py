"""Which divisor a run pre-scales its datums for (grpo.core.normalization.service_divisor;
docs/FORMULAS.md, "Service normalization")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.normalization import (
    DEFAULT_SERVICE_NORMALIZATION,
    LOCAL_TRAIN_NORMALIZATION,
    NORMALIZATIONS,
    ServiceDivisor,
    service_divisor,
)

MAYBE = st.one_of(st.none(), st.sampled_from(NORMALIZATIONS))


@given(st.sampled_from(["local", "pytrio"]), MAYBE, MAYBE, MAYBE)
def test_the_divisor_follows_the_documented_precedence(backend, flag, probed, reported):
    if backend == "local":  # what the embedded backend divides by: it says so, or was asked
        expected = ServiceDivisor(reported or flag or LOCAL_TRAIN_NORMALIZATION, "local")
    elif flag is not None:  # a service: the user's word, then the measurement, then the docs
        expected = ServiceDivisor(flag, "flag")
    elif probed is not None:
        expected = ServiceDivisor(probed, "probe")
    else:
        expected = ServiceDivisor(DEFAULT_SERVICE_NORMALIZATION, "default")
    assert service_divisor(backend, flag, probed, reported) == expected


def test_the_documented_defaults():
    assert DEFAULT_SERVICE_NORMALIZATION == "samples"
    assert LOCAL_TRAIN_NORMALIZATION == "sum"


def test_an_unknown_convention_is_refused_naming_its_source():
    with pytest.raises(ValueError, match="--service-normalization 'mean'"):
        service_divisor("pytrio", "mean", None)
    with pytest.raises(ValueError, match="the probe's verdict 'x'"):
        service_divisor("pytrio", None, "x")
