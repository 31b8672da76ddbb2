"""Loading user code named on the command line: `MODULE:NAME` or `path/to/file.py:NAME`.

`--reward` (`grpo/rewards/__init__.py`) and `--env` (`grpo/envs/base.py`) both name a callable this
way; each parses its own flag (a reward adds `=WEIGHT`) and loads the callable here. Every
error is a ValueError that names the flag, the spec as given and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load_callable", "load_module"]


def load_module(flag: str, spec: str, target: str, *, namespace: str) -> ModuleType:
    """The module ``target`` names (a ``.py`` file path or a module path); ValueError otherwise.

    A file is imported once per process as ``grpo_user_<namespace>_<hash of its path>``.
    """
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{flag} {spec!r}: file {str(path)!r} not found (relative paths start at "
                f"{Path.cwd()})"
            )
        module_name = f"grpo_user_{namespace}_{abs(hash(str(path.resolve())))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{flag} {spec!r}: cannot load {path} as a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit, KeyboardInterrupt) as error:  # exit at import too
            del sys.modules[module_name]
            raise ValueError(
                f"{flag} {spec!r}: importing {path} failed: {type(error).__name__}: {error}"
            ) from error
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"{flag} {spec!r}: no module {error.name!r}; give an importable module path or "
            "a file path ending in .py"
        ) from None
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        raise ValueError(
            f"{flag} {spec!r}: importing {target} failed: {type(error).__name__}: {error}"
        ) from error


def load_callable(
    flag: str, spec: str, target: str, name: str, *, namespace: str
) -> Callable[..., Any]:
    """``target:name`` loaded and checked callable; ValueError listing the module's callables."""
    module = load_module(flag, spec, target, namespace=namespace)
    if not hasattr(module, name):
        public = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_")
        )
        raise ValueError(
            f"{flag} {spec!r}: {target} has no {name!r}; its callables: "
            f"{', '.join(public) or 'none'}"
        )
    value = getattr(module, name)
    if not callable(value):
        raise ValueError(
            f"{flag} {spec!r}: {target}:{name} is a {type(value).__name__}, not callable"
        )
    return value
