"""The import rules of docs/DESIGN.md, checked on the source with ``ast``.

- The functional core (``grpo/core``) imports nothing from the shell and not pytrio.
- A backend (``grpo/backends``) imports from grpo only ``grpo.core`` and other backend
  modules (``grpo.backends.datums`` is the Datum boundary the shell shares).
- ``grpo serve`` (``grpo/serve``) imports of the local backend only its public face, the
  package ``grpo.backends.local`` itself, never one of its modules.
- Inside grpo nothing but the CLI (``grpo/cli.py``) imports ``grpo.serve``; tests and
  benchmarks may.
- ``grpo --help`` loads neither torch nor transformers.
- No import circle anywhere under ``grpo/``: a circle is a seam in the wrong place.

Every import counts, including those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "grpo"


def _module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """``grpo/training/recipes/grpo/run.py`` -> ``grpo.training.recipes.grpo.run``; an ``__init__``
    -> its package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_grpo_module(name: str, package_root: Path = PACKAGE_ROOT) -> bool:
    """Whether ``name`` is a module or package of the grpo source tree at ``package_root``."""
    relative = Path(*name.split("."))
    root = package_root.parent
    is_file = (root / relative).with_suffix(".py").is_file()
    return is_file or (root / relative / "__init__.py").is_file()


def imported_modules(
    source: str, module: str, is_package: bool = False, root: Path = PACKAGE_ROOT
) -> Iterator[tuple[int, str]]:
    """(line, module) for every import statement anywhere in ``source``.

    ``from X import name`` counts as importing ``X.name`` when that is a grpo module (so
    ``from grpo.training import run`` imports ``grpo.training.recipes.grpo.run``), else as importing
    ``X``. Relative imports are resolved against ``module``.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield node.lineno, submodule if _is_grpo_module(submodule, root) else base


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(
    subpackage: str,
    allowed: Callable[[str], bool],
    *,
    exempt: tuple[str, ...] = (),
    root: Path = PACKAGE_ROOT,
) -> list[str]:
    """``path:line imports X`` for each import under ``grpo/<subpackage>`` ``allowed`` rejects,
    except in the modules and packages named in ``exempt``; ``root`` is the ``grpo`` tree."""
    found = []
    for path in sorted((root / subpackage).rglob("*.py")):
        module = _module_name(path, root)
        if any(_within(module, name) for name in exempt):
            continue
        source = path.read_text(encoding="utf-8")
        for line, name in imported_modules(source, module, path.name == "__init__.py"):
            if not allowed(name):
                found.append(f"{path.relative_to(root.parent)}:{line} imports {name}")
    return found


def core_may_import(name: str) -> bool:
    """The core: anything but pytrio and the grpo modules outside grpo.core."""
    if _within(name, "pytrio"):
        return False
    return not _within(name, "grpo") or _within(name, "grpo.core")


def backend_may_import(name: str) -> bool:
    """A backend: from grpo only grpo.core and grpo.backends."""
    if not _within(name, "grpo"):
        return True
    return any(_within(name, allowed) for allowed in ("grpo.core", "grpo.backends"))


def serve_may_import(name: str) -> bool:
    """grpo.serve: of the local backend only the package itself (its public face)."""
    return name == "grpo.backends.local" or not _within(name, "grpo.backends.local")


def may_import_serve(name: str) -> bool:
    """Any grpo module but the CLI and grpo.serve itself: anything but grpo.serve."""
    return not _within(name, "grpo.serve")


SERVE_IMPORTERS = ("grpo.cli", "grpo.serve")
"""The grpo modules that may import grpo.serve: the CLI, and the package itself."""


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Each grpo module -> the grpo modules it imports (a package means its ``__init__``)."""

    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        source = path.read_text(encoding="utf-8")
        is_package = path.name == "__init__.py"
        names = {name for _, name in imported_modules(source, module, is_package, root)}
        graph[module] = {name for name in names if _is_grpo_module(name, root)}
        graph[module].discard(module)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_circle_finder_sees_a_planted_circle_through_a_deferred_import(tmp_path: Path):
    package = tmp_path / "grpo"
    (package / "training").mkdir(parents=True)
    for path, source in {
        "__init__.py": "",
        "training/__init__.py": "",
        "training/a.py": "from grpo.training.b import x\n",
        "training/b.py": "def x():\n    from grpo.training import c\n",
        "training/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from grpo.training.a import y\n",
        "training/d.py": "import grpo.training.a\n",
    }.items():
        (package / path).write_text(source)
    assert import_circles(import_graph(package)) == [
        ["grpo.training.a", "grpo.training.b", "grpo.training.c"]
    ]


def test_there_is_no_import_circle_under_grpo():
    circles = import_circles(import_graph())
    assert not circles, "import circles (move the shared piece below both): " + "; ".join(
        " <-> ".join(circle) for circle in circles
    )


def test_the_import_scanner_sees_imports_in_functions_relative_and_from_package():
    source = textwrap.dedent(
        """
        import numpy
        from grpo.training.recipes.grpo import run
        from . import records
        from ..backends.datums import batch_to_datums

        def later():
            from grpo.training.custom_loss import datum_mask
        """
    )
    assert sorted(name for _, name in imported_modules(source, "grpo.core.losses")) == [
        "grpo.backends.datums",
        "grpo.core.records",
        "grpo.training.custom_loss",
        "grpo.training.recipes.grpo.run",
        "numpy",
    ]
    assert not core_may_import("grpo.training.custom_loss") and not core_may_import("pytrio.types")
    assert core_may_import("grpo.core.records") and core_may_import("torch")
    assert not backend_may_import("grpo.tasks.prompts") and backend_may_import(
        "grpo.backends.datums"
    )


def test_the_serve_rules_reject_a_local_backend_module_and_serve_outside_the_cli(
    tmp_path: Path,
) -> None:
    served = textwrap.dedent(
        """
        from grpo.backends.local import LocalServiceClient, lora_wire_fields
        from grpo.backends.local.checkpoint import resolve
        from grpo.backends import local

        def later():
            import grpo.backends.local.clients
        """
    )
    names = [name for _, name in imported_modules(served, "grpo.serve.registry")]
    assert [name for name in names if not serve_may_import(name)] == [
        "grpo.backends.local.checkpoint",
        "grpo.backends.local.clients",
    ]
    # A deliberate violation in a synthetic grpo tree: a shell module imports grpo.serve.
    tree = tmp_path / "grpo"
    sources = {
        "cli.py": "from grpo.serve.command import run_serve\n",
        "serve/__init__.py": "",
        "serve/command.py": "from grpo.serve.server import serve_in_thread\n",
        "serve/registry.py": "from grpo.backends.local.checkpoint import resolve\n",
        "training/__init__.py": "",
        "training/loop.py": "def later():\n    import grpo.serve.server\n",
    }
    for relative, source in sources.items():
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        (tree / relative).write_text(source)
    assert violations("", may_import_serve, exempt=SERVE_IMPORTERS, root=tree) == [
        "grpo/training/loop.py:2 imports grpo.serve.server"
    ]
    assert violations("serve", serve_may_import, root=tree) == [
        "grpo/serve/registry.py:1 imports grpo.backends.local.checkpoint"
    ]


def test_the_core_imports_neither_the_shell_nor_pytrio():
    found = violations("core", core_may_import)
    assert found == [], "the core must not import the shell or pytrio:\n" + "\n".join(found)


def test_backends_import_only_the_core_datums_and_other_backends():
    found = violations("backends", backend_may_import)
    assert found == [], (
        "a backend may import from grpo only grpo.core, grpo.backends.datums and grpo.backends:\n"
        + "\n".join(found)
    )


def test_serve_imports_only_the_public_face_of_the_local_backend():
    found = violations("serve", serve_may_import)
    assert found == [], (
        "grpo.serve may import from the local backend only grpo.backends.local itself:\n"
        + "\n".join(found)
    )


def test_nothing_in_grpo_but_the_cli_imports_serve():
    found = violations("", may_import_serve, exempt=SERVE_IMPORTERS)
    assert found == [], "only grpo/cli.py may import grpo.serve:\n" + "\n".join(found)


_HEAVY_MODULES_AFTER_HELP = """
import contextlib, io, sys
from grpo.cli import main
for argv in (["--help"], ["train", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
print(" ".join(sorted(name for name in ("torch", "transformers") if name in sys.modules)))
"""


def test_grpo_help_loads_neither_torch_nor_transformers():
    result = subprocess.run(
        [sys.executable, "-c", _HEAVY_MODULES_AFTER_HELP],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = result.stdout.split()
    assert loaded == [], f"`grpo --help` and `grpo train --help` loaded {', '.join(loaded)}"
