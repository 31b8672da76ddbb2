"""mkdocs hook: the site's home page is README.md, its links into docs/ made site-relative."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """README.md's text for index.md, with `](docs/X)` links and images rewritten to `](X)`."""
    if page.file.src_uri != "index.md":
        return markdown
    return re.sub(r"\]\(docs/", "](", README.read_text(encoding="utf-8"))
