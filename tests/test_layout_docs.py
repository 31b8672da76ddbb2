"""The module tree of docs/DESIGN.md ("Module layout") lists every module under grpo/ and
nothing that does not exist, so it cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"__init__.py", "__main__.py"}  # listed where they carry a public face


def listed_paths(markdown: str, heading: str) -> set[str]:
    """Paths (``grpo/core/losses.py``, ``grpo/core/``) of the tree under ``heading``.

    An entry is a line whose first word ends in ``.py`` or ``/``; two spaces of indent are
    one level; other lines (continued descriptions) are skipped.
    """
    section = markdown.split(heading, 1)[1]
    block = re.search(r"```(?:text)?\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"no tree under {heading!r}"
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.group(1).splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if not (word.endswith(".py") or word.endswith("/")):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        stack = [*stack[:depth], word]
        if stack[0] == "grpo/":
            paths.add("".join(stack))
    return paths


def actual_modules() -> set[str]:
    """Every .py file under grpo/ except the optional ones, as repo-relative paths."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "grpo").rglob("*.py")
        if path.name not in OPTIONAL
    }


@pytest.mark.parametrize(("document", "heading"), [("docs/DESIGN.md", "## Module layout")])
def test_the_layout_tree_lists_every_module_and_only_real_paths(document: str, heading: str):
    listed = listed_paths((ROOT / document).read_text(encoding="utf-8"), heading)
    missing = sorted(actual_modules() - listed)
    unknown = sorted(path for path in listed if not (ROOT / path).exists())
    assert missing == [], f"{document} does not list: {', '.join(missing)}"
    assert unknown == [], f"{document} lists paths that do not exist: {', '.join(unknown)}"


def test_the_tree_parser_reads_nesting_and_skips_continued_descriptions():
    markdown = (
        "## Layout\n```\ngrpo/\n  core/        pure\n    losses.py  kernels,\n"
        "               and more\n  cli.py       the command\ndocs/        docs\n```\n"
    )
    assert listed_paths(markdown, "## Layout") == {
        "grpo/",
        "grpo/core/",
        "grpo/core/losses.py",
        "grpo/cli.py",
    }
