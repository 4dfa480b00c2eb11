"""The docs updater: a benchmark's tables and plots into the block of a docs page it owns.

A block is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in a page under
``docs/``; :func:`update_docs` replaces only that text (the markers and the rest of the page
stay) and copies the plots to ``docs/assets/benchmarks/``, linked at the top of the block.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from collections.abc import Sequence

__all__ = ["ASSETS", "DocsBlock", "replace_section", "update_docs"]

ASSETS = pathlib.PurePosixPath("assets/benchmarks")
"""Where the plots go, relative to the docs directory."""


@dataclasses.dataclass(frozen=True)
class DocsBlock:
    """A marked block of a docs page: ``page`` (relative to ``docs/``) and the marker ``name``."""

    page: str
    name: str

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"


def replace_section(page: pathlib.Path, begin: str, end: str, body: str) -> None:
    """Put ``body`` into ``page`` between the markers ``begin`` and ``end`` (both kept).

    Raises ``RuntimeError`` naming the page and the markers when it does not hold them in order.
    """
    content = page.read_text()
    start, stop = content.find(begin), content.find(end)
    if start < 0 or stop < start:
        raise RuntimeError(f"{page} has no {begin} ... {end} section to hold the table")
    page.write_text(content[: start + len(begin)] + body + content[stop:])


def update_docs(
    docs: pathlib.Path, block: DocsBlock, text: str, images: Sequence[pathlib.Path] = ()
) -> pathlib.Path:
    """Copy ``images`` to ``docs/assets/benchmarks`` and put their links and ``text`` into ``block``.

    Returns the page written.
    """
    page = pathlib.Path(docs) / block.page
    if not page.exists():
        raise RuntimeError(f"{page} does not exist: --docs takes the docs directory (docs/)")
    assets = pathlib.Path(docs) / ASSETS
    links = []
    if images:
        assets.mkdir(parents=True, exist_ok=True)
    depth = "../" * block.page.count("/")
    for image in images:
        shutil.copy2(image, assets / image.name)
        links.append(f"![{image.stem}]({depth}{ASSETS / image.name})")
    body = "\n\n".join([*links, text.strip()])
    replace_section(page, block.begin, block.end, "\n\n" + body + "\n\n")
    return page
