"""mkdocs hook: fill the configuration page with the reference rendered from the code.

``docs/configuration.md`` holds the marker below; at build time it is replaced by
``zero_full.config.reference.render_markdown()`` (every key of every section with its type,
default, DeepSpeed spellings, stages and description), so the page cannot drift from the
config classes. The ``docs`` nox session installs zero-full for this.
"""

from __future__ import annotations

import warnings
from typing import Any

MARKER = "<!-- zero:config-reference -->"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace :data:`MARKER` with the rendered reference (pages without it are unchanged)."""
    if MARKER not in markdown:
        return markdown
    with warnings.catch_warnings():  # torch warns at import when numpy is absent (the docs venv)
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            from zero_full.config.reference import render_markdown
        except ImportError as exc:
            from mkdocs.exceptions import PluginError  # mkdocs only: the docs test imports this hook too

            raise PluginError(
                f"the configuration reference needs zero-full from this checkout ({exc}); build with "
                "`nox -s docs`, or `pip install -e packages/zero-full` (and its zero dependencies) first"
            ) from exc

    return markdown.replace(MARKER, render_markdown(heading_level=2))
