"""mkdocs hook: every public name of every package is documented on its package page.

For each ``packages/<dist>.md`` page, the names in the package's ``__all__`` (read from its
``__init__.py`` without importing it) must each have an anchor on the rendered page: an
``id`` equal to ``<module>.<name>`` or ending in ``.<name>``. A missing one is logged as a
warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.api_coverage")

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"zero-kernels": ROOT / "kernels" / "src" / "zero_kernels"}


def _package_dir(dist: str) -> Path:
    return SOURCES.get(dist, ROOT / "packages" / dist / "src" / dist.replace("-", "_"))


def public_names(init: Path) -> list[str]:
    """The ``__all__`` of a module file (empty when it has none): its literal names, and those of a
    sibling module's ``__all__`` it takes in (``+= module.__all__`` or ``[..., *module.__all__]``)."""
    names: list[str] = []
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                names = _names(node.value, init)
        elif isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == "__all__":
            names += _names(node.value, init)
    return names


def _sibling_all(node: ast.expr, init: Path) -> list[str] | None:
    """The names of ``module.__all__`` for a sibling ``module`` of ``init``; ``None``: not that form."""
    if isinstance(node, ast.Attribute) and node.attr == "__all__" and isinstance(node.value, ast.Name):
        return public_names(init.parent / f"{node.value.id}.py")
    return None


def _names(value: ast.expr, init: Path) -> list[str]:
    """The names an ``__all__`` expression holds (see :func:`public_names`)."""
    sibling = _sibling_all(value, init)
    if sibling is not None:
        return sibling
    if isinstance(value, ast.List | ast.Tuple):
        names: list[str] = []
        for elt in value.elts:
            names += _names(elt.value, init) if isinstance(elt, ast.Starred) else [ast.literal_eval(elt)]
        return names
    return list(ast.literal_eval(value))


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Warn about every ``__all__`` name without an anchor on its package page."""
    match = re.fullmatch(r"packages/([\w-]+)\.md", page.file.src_uri)
    if match is None:
        return html
    dist = match.group(1)
    init = _package_dir(dist) / "__init__.py"
    if not init.exists():
        return html
    ids = set(re.findall(r'id="([^"]+)"', html))
    module = dist.replace("-", "_")
    for name in public_names(init):
        if f"{module}.{name}" not in ids and not any(i.endswith(f".{name}") for i in ids):
            log.warning("%s: public name %s.%s has no API entry on the page", page.file.src_uri, module, name)
    return html
