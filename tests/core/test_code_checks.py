"""grpo.core.code_checks: plain data round-trips exactly; an assert's expected side stays out."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.core import code_checks

_namespace: dict[str, Any] = {}
exec(code_checks.ENCODER_SOURCE, _namespace)
ENCODE = _namespace["_grpo_plain_"]

_hashable = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=8)
plain = st.recursive(
    _hashable | st.floats(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.frozensets(_hashable, max_size=4)
        | st.sets(_hashable, max_size=4)
        | st.dictionaries(_hashable, children, max_size=4)
    ),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the very same types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


@given(plain)
def test_a_plain_value_survives_the_encoder_the_decoder_and_plain_source_exactly(value: Any):
    decoded = code_checks.decode_plain(ENCODE(value, 0, [code_checks.MAX_NODES]))
    assert _same(decoded, value)
    assert _same(eval(code_checks.plain_source(decoded)), value)


@pytest.mark.parametrize(
    "value", [type("Mine", (), {})(), type("Str", (str,), {})("x"), True.__class__, 1j]
)
def test_anything_not_exactly_plain_is_refused(value: Any):
    with pytest.raises(code_checks.NotPlain):
        code_checks.decode_plain(ENCODE(value, 0, [code_checks.MAX_NODES]))


@given(st.integers(-(10**6), 10**6), st.text(alphabet="xyz", min_size=1, max_size=6))
def test_an_asserts_expected_side_never_enters_the_sandbox_text(argument: int, expected: str):
    marker = f"EXPECTED_{expected}"
    (check,) = code_checks.split_checks([f"assert f({argument}) == {marker!r}"])
    assert marker not in check.sandbox and f"f({argument})" in check.sandbox
    assert marker in check.harness and check.literal == ("==", marker)
    assert code_checks.literal_verdict(check, {check.holes[0]: marker})
    assert not code_checks.literal_verdict(check, {})
