"""Code tests split so the code under test cannot touch their verdict: holes, plain data.

A test statement's *holes* are its outermost expressions that reach the solution: a name
the tests use but neither bind nor take from builtins (`double` in `assert double(2) ==
4`), or a name an earlier statement bound from a hole (`x` after `x = double(3)`), with
the calls, attributes and subscripts applied to it (`double(2)`, `s.pop()`, `f(3)[0]`).

- `split_checks`: the statements of the tests, each with its holes, the text the sandbox
  runs (the solution's side: setup statements whole, of an assert only its holes, so an
  assert's expected value never enters the sandbox) and the text the harness runs (the
  verdict's side: the statement with each hole replaced by its value).
- `decode_plain`: a hole's value as it leaves the sandbox (tagged JSON), checked to be
  plain data (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, to a
  bounded depth and size) or refused; no object of the solution's own survives it.
- `plain_source`: Python text that rebuilds a plain value, for the harness program.
- `literal_verdict`: an assert of the form `HOLE == literal` (also `!=`, `is None/True/
  False`, `HOLE`, `not HOLE`) decided here on plain data, without a harness process.
"""

from __future__ import annotations

import ast
import builtins
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "ENCODER_SOURCE",
    "HOLE_FUNCTION",
    "RECORD_FUNCTION",
    "Check",
    "NotPlain",
    "decode_plain",
    "literal_verdict",
    "plain_source",
    "split_checks",
]

RECORD_FUNCTION = "_grpo_record_"
HOLE_FUNCTION = "_grpo_hole_"
MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_INT_DIGITS = 4300
_BUILTINS = frozenset(dir(builtins))

ENCODER_SOURCE = f"""\
def _grpo_plain_(value, depth, budget):
    budget[0] -= 1
    if budget[0] < 0 or depth > {MAX_DEPTH}:
        return ["o", "value over the size or depth bound"]
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        try:
            return ["i", str(value)]
        except ValueError:
            return ["o", "int over the digit bound"]
    if kind is float:
        return ["f", repr(value)]
    if kind is bytes:
        return ["b", value.hex()]
    tag = {{list: "l", tuple: "t", set: "s", frozenset: "fs"}}.get(kind)
    if tag is not None:
        return [tag, [_grpo_plain_(item, depth + 1, budget) for item in value]]
    if kind is dict:
        return ["d", [[_grpo_plain_(key, depth + 1, budget), _grpo_plain_(item, depth + 1, budget)]
                      for key, item in value.items()]]
    return ["o", kind.__name__]
"""
"""The encoder the sandbox runs on each hole's value, `_grpo_plain_(value, 0, [MAX_NODES])`:
the tagged JSON `decode_plain` reads (exact types only: a subclass is `["o", name]`)."""
_LITERAL_SINGLETONS = (None, True, False)


class NotPlain(ValueError):
    """A value out of the sandbox that is not plain data (or not well formed)."""


@attrs.frozen
class Check:
    """One top-level test statement: its holes, the sandbox's text and the harness's text.

    `literal` is (operator, expected) when the statement is an assert on its one hole that
    `literal_verdict` decides without a harness: operator is one of `==`, `!=`, `is`,
    `is not`, `truth`, `not`; None otherwise.
    """

    source: str
    is_assert: bool
    holes: tuple[int, ...]
    sandbox: str
    harness: str
    literal: tuple[str, Any] | None


def _bound_names(node: ast.AST) -> set[str]:
    """Every name `node` binds anywhere inside it: targets, arguments, defs, imports."""
    names: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
            names.add(child.id)
        elif isinstance(child, ast.arg):
            names.add(child.arg)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(child.name)
        elif isinstance(child, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in child.names)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
        elif isinstance(child, ast.Global | ast.Nonlocal):
            names.update(child.names)
    return names


def _top_bound_names(statement: ast.stmt) -> set[str]:
    """The names a top-level statement binds in the module namespace (not in nested scopes)."""
    scoped = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    scoped += (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    names: set[str] = set()
    stack: list[ast.AST] = [statement]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        if node is statement or not isinstance(node, scoped):
            stack.extend(ast.iter_child_nodes(node))
    return names


def _chain_base(node: ast.expr) -> ast.expr:
    """The innermost value of a chain of calls, attributes and subscripts (`f` of `f(1)[0]`)."""
    while isinstance(node, ast.Call | ast.Attribute | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


class _Holes(ast.NodeTransformer):
    """Replaces each outermost chain whose base is a hole name by `replace(index, node)`."""

    def __init__(self, hole_names: set[str], first: int, replace: Any) -> None:
        self.hole_names = hole_names
        self.next = first
        self.replace = replace
        self.found: list[ast.expr] = []

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Starred):
            base = _chain_base(node)
            is_load = not isinstance(getattr(node, "ctx", ast.Load()), ast.Store | ast.Del)
            if isinstance(base, ast.Name) and base.id in self.hole_names and is_load:
                self.found.append(node)
                self.next += 1
                return ast.copy_location(self.replace(self.next - 1, node), node)
        return self.generic_visit(node)


def _call(name: str, *args: ast.expr) -> ast.expr:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


def _record(index: int, node: ast.expr, reraise: bool) -> ast.expr:
    thunk = ast.Lambda(
        args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=node,
    )
    return _call(RECORD_FUNCTION, ast.Constant(index), thunk, ast.Constant(reraise))


def _literal(statement: ast.Assert, hole_sources: Sequence[str]) -> tuple[str, Any] | None:
    """(operator, expected) when the assert is one of `literal_verdict`'s forms, else None."""
    test = statement.test
    if len(hole_sources) != 1:
        return None
    if _is_hole_call(test):
        return ("truth", None)
    if (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and _is_hole_call(test.operand)
    ):
        return ("not", None)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, right, op = test.left, test.comparators[0], test.ops[0]
    if _is_hole_call(right) and not _is_hole_call(left) and isinstance(op, ast.Eq | ast.NotEq):
        left, right = right, left
    if not _is_hole_call(left):
        return None
    try:
        expected = ast.literal_eval(right)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(op, ast.Eq | ast.NotEq):
        return ("==" if isinstance(op, ast.Eq) else "!=", expected)
    if isinstance(op, ast.Is | ast.IsNot) and any(expected is s for s in _LITERAL_SINGLETONS):
        return ("is" if isinstance(op, ast.Is) else "is not", expected)
    return None


def _is_hole_call(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == HOLE_FUNCTION
    )


def split_checks(sources: Sequence[str]) -> list[Check]:
    """Each top-level statement of the tests, split into its sandbox and harness texts.

    ValueError (naming the statement and the fix) for a test that is not Python, that
    holds no assert, or that reaches the solution with a name bound inside the statement
    (a comprehension, loop or function of the test calling the solution).
    """
    modules = []
    for source in sources:
        if not isinstance(source, str):
            raise ValueError(
                f"a test is {source!r} ({type(source).__name__}); expected Python text"
            )
        try:
            modules.append((source, ast.parse(source)))
        except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
            raise ValueError(f"test {source[:80]!r} is not valid Python: {error}") from None
    bound: set[str] = set()
    loaded: set[str] = set()
    for _, module in modules:
        bound |= _bound_names(module)
        loaded |= {
            node.id
            for node in ast.walk(module)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
    hole_names = loaded - bound - _BUILTINS - {RECORD_FUNCTION, HOLE_FUNCTION}
    # A standard module the tests use without importing it (the solution did) is imported
    # on both sides, so that `math.isclose(f(1), 2.0)` is decided outside the sandbox.
    # Only a name used as `name.attribute` alone (the built-in task `chunk` is a module too).
    as_attribute_base = {
        id(node.value)
        for _, module in modules
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }
    elsewhere = {
        node.id
        for _, module in modules
        for node in ast.walk(module)
        if isinstance(node, ast.Name) and id(node) not in as_attribute_base
    }
    modules_used = sorted((hole_names & set(sys.stdlib_module_names)) - elsewhere)
    hole_names -= set(modules_used)
    checks = [
        Check(
            source=f"import {name}",
            is_assert=False,
            holes=(),
            sandbox=f"import {name}",
            harness=f"import {name}",
            literal=None,
        )
        for name in modules_used
    ]
    next_hole = 0
    for source, module in modules:
        for statement in module.body:
            segment = ast.get_source_segment(source, statement)
            assert segment is not None
            is_assert = isinstance(statement, ast.Assert)
            harness = _Holes(
                hole_names, next_hole, lambda k, _n: _call(HOLE_FUNCTION, ast.Constant(k))
            )
            harness_tree = harness.visit(ast.parse(segment).body[0])
            holes = tuple(range(next_hole, harness.next))
            inner = _bound_names(statement) - _top_bound_names(statement)
            if isinstance(statement, ast.For | ast.AsyncFor | ast.With | ast.AsyncWith):
                inner |= _top_bound_names(statement)
            for node in harness.found:
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if used & inner:
                    raise ValueError(
                        f"test {segment[:80]!r} calls the solution with "
                        f"{sorted(used & inner)[0]!r}, a name bound inside the statement (a "
                        "comprehension, loop or function of the test); write one statement "
                        "per call, e.g. `assert f(1) == 2`"
                    )
            if is_assert:
                sandbox = "\n".join(
                    ast.unparse(_record(k, node, False))
                    for k, node in zip(holes, harness.found, strict=True)
                )
            elif holes:
                recorder = _Holes(hole_names, next_hole, lambda k, n: _record(k, n, True))
                sandbox = ast.unparse(recorder.visit(ast.parse(segment).body[0]))
                hole_names |= _top_bound_names(statement)
            else:
                sandbox = segment
            harness_text = ast.unparse(ast.fix_missing_locations(harness_tree))
            literal = None
            if is_assert:
                assert isinstance(harness_tree, ast.Assert)
                literal = _literal(harness_tree, [ast.unparse(n) for n in harness.found])
            checks.append(
                Check(
                    source=segment,
                    is_assert=is_assert,
                    holes=holes,
                    sandbox=sandbox,
                    harness=harness_text,
                    literal=literal,
                )
            )
            next_hole = harness.next
    if not any(check.is_assert for check in checks):
        raise ValueError(f"tests {list(sources)!r} hold no assert statement")
    return checks


def decode_plain(encoded: Any) -> Any:
    """The plain value a tagged-JSON hole encodes; NotPlain naming why when it is not one.

    The tags: JSON null/true/false/strings stand for themselves; `["i", "12"]` int,
    `["f", "1.5"]` float (`"nan"`, `"inf"`, `"-inf"` too), `["b", "hex"]` bytes, `["l"|
    "t"|"s"|"fs", [...]]` list, tuple, set, frozenset, `["d", [[k, v], ...]]` dict;
    `["o", "Type"]` is the sandbox's mark for a value that is not plain (refused here).
    """
    budget = [MAX_NODES]
    return _decode(encoded, 0, budget)


def _decode(encoded: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise NotPlain(f"the value has more than {MAX_NODES} parts")
    if depth > MAX_DEPTH:
        raise NotPlain(f"the value is nested deeper than {MAX_DEPTH}")
    if encoded is None or isinstance(encoded, bool | str):
        return encoded
    if not (isinstance(encoded, list) and len(encoded) == 2 and isinstance(encoded[0], str)):
        raise NotPlain(f"malformed value {str(encoded)[:80]!r}")
    tag, body = encoded
    if tag == "o":
        raise NotPlain(f"the solution returned a {str(body)[:80]}, not plain data")
    if tag == "i" and isinstance(body, str):
        digits = body.removeprefix("-")
        if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_INT_DIGITS):
            raise NotPlain(f"malformed integer {body[:80]!r}")
        return int(body)
    if tag == "f" and isinstance(body, str) and len(body) <= 32:
        try:
            return float(body)
        except ValueError:
            raise NotPlain(f"malformed float {body!r}") from None
    if tag == "b" and isinstance(body, str):
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise NotPlain("malformed bytes") from None
    if tag in ("l", "t", "s", "fs") and isinstance(body, list):
        items = [_decode(item, depth + 1, budget) for item in body]
        try:
            return {"l": list, "t": tuple, "s": set, "fs": frozenset}[tag](items)
        except TypeError:
            raise NotPlain("a set holds an unhashable value") from None
    if tag == "d" and isinstance(body, list):
        pairs = []
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise NotPlain("malformed dict entry")
            pairs.append((_decode(pair[0], depth + 1, budget), _decode(pair[1], depth + 1, budget)))
        try:
            return dict(pairs)
        except TypeError:
            raise NotPlain("a dict key is unhashable") from None
    raise NotPlain(f"malformed value with tag {tag[:20]!r}")


def plain_source(value: Any) -> str:
    """Python text that evaluates to `value`, a plain value `decode_plain` returned."""
    if value is None or isinstance(value, bool | int | str | bytes):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(plain_source(item) for item in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(plain_source(item) + ", " for item in value) + ")"
    if isinstance(value, set | frozenset):
        inner = "[" + ", ".join(plain_source(item) for item in value) + "]"
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{plain_source(k)}: {plain_source(v)}" for k, v in value.items()) + "}"
        )
    raise NotPlain(f"{type(value).__name__} is not plain data")


def literal_verdict(check: Check, values: Mapping[int, Any]) -> bool:
    """Whether `check` (with a `literal`) passes given its hole's plain value; False if absent."""
    assert check.literal is not None
    (hole,) = check.holes
    if hole not in values:
        return False
    value = values[hole]
    operator, expected = check.literal
    try:
        if operator == "==":
            return bool(value == expected)
        if operator == "!=":
            return bool(value != expected)
        if operator == "is":
            return value is expected
        if operator == "is not":
            return value is not expected
        if operator == "truth":
            return bool(value)
        return not value
    except (RecursionError, MemoryError):
        return False
