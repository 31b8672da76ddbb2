"""grpo.plugins: `MODULE:NAME` / `FILE.py:NAME` loading, errors naming the flag and the fix."""

from __future__ import annotations

import pytest

from grpo.plugins import load_callable, load_module


def test_a_file_loads_once_per_namespace_and_a_module_by_its_path(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def f():\n    return 1\n")
    first = load_module("--x", "spec", str(path), namespace="x")
    assert load_module("--x", "spec", str(path), namespace="x") is first
    assert load_module("--y", "spec", str(path), namespace="y") is not first
    assert load_callable("--x", "spec", str(path), "f", namespace="x")() == 1
    assert load_callable("--x", "spec", "math", "sqrt", namespace="x")(4.0) == 2.0


@pytest.mark.parametrize(
    ("target", "name", "message"),
    [
        ("missing.py", "f", r"--flag 'S': file 'missing.py' not found"),
        ("no_such_module_xyz", "f", r"--flag 'S': no module 'no_such_module_xyz'; give an"),
        ("math", "nope", r"--flag 'S': math has no 'nope'; its callables: .*sqrt"),
        ("math", "pi", r"--flag 'S': math:pi is a float, not callable"),
    ],
)
def test_errors_name_the_flag_the_spec_and_the_fix(target, name, message):
    with pytest.raises(ValueError, match=message):
        load_callable("--flag", "S", target, name, namespace="t")


def test_a_file_that_raises_on_import_is_not_left_half_loaded(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"importing .*broken.py failed: RuntimeError: boom"):
            load_module("--flag", "S", str(path), namespace="t")
