"""What a benchmark run writes: :class:`Report` (JSON, markdown, plots, docs block) and its parts.

Every benchmark ends in one :class:`Report`: ``<stem>.json`` holds everything measured (with
:func:`environment`), ``<stem>.md`` the tables (built with :func:`markdown_table`), the plots
``<stem>*.png`` come from the benchmark's plot function, and with ``--docs`` the tables (and
plots) go into the docs page block the benchmark owns (:mod:`benchmarks.kit.docs`). Each result
names the command that measured it (:func:`command_line`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from benchmarks.kit.docs import DocsBlock, update_docs

__all__ = [
    "THREAD_VARIABLES",
    "Report",
    "command_env",
    "command_line",
    "environment",
    "markdown_table",
    "versions",
    "write_results",
]

PlotFn = Callable[[dict[str, Any], pathlib.Path, str], list[pathlib.Path]]
"""``plot(result, out, stem)``: write the figures of ``result`` under ``out``, return their paths."""


def versions(*dists: str) -> dict[str, str | None]:
    """Installed version of each distribution (``None`` when it is not installed)."""
    found: dict[str, str | None] = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def environment(*dists: str) -> dict[str, Any]:
    """Date (UTC), python, machine, core count, 1-minute load and the versions of ``torch`` + ``dists``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "versions": versions("torch", *dists),
    }


THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
"""Environment variables that set how many threads each rank's operators use."""


def command_env() -> str:
    """The settings in the environment that shape a timing, as a command prefix ("" if none).

    * glibc's allocator (``MALLOC_*``): how often freed memory goes back to the kernel, and so
      how many page faults a step pays;
    * operator threads (:data:`THREAD_VARIABLES`): with two ranks on two cores, torch's
      default of one thread per core puts two threads of each rank on the same cores
      (``nox -s bench`` sets ``OMP_NUM_THREADS=1``).

    A result measured with them names them, so its command reproduces it.
    """
    return "".join(
        f"{k}={v} " for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k in THREAD_VARIABLES
    )


def command_line(name: str, argv: Sequence[str] | None = None) -> str:
    """How to run benchmark ``name`` again as this process was run: :func:`command_env` first.

    Args:
        name: The registered name (printed as ``python -m benchmarks <name>``).
        argv: The benchmark's arguments (``None``: ``sys.argv[2:]``, what followed the name).
    """
    args = sys.argv[2:] if argv is None else argv
    return " ".join([f"{command_env()}python -m benchmarks {name}", *args])


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend (imported on first use: plots are optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: pathlib.Path) -> pathlib.Path:
    """Lay ``fig`` out, write it to ``path`` at the resolution every plot uses, and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A GitHub markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: ``l``).

    Cells are written with ``str``; format numbers before passing them.
    """
    headers = list(headers)
    if align and len(align) != len(headers):
        raise ValueError(f"align {align!r} needs one letter per column ({len(headers)} columns)")
    marks = ["---:" if (align[i] if align else "l") == "r" else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {cells!r} has {len(cells)} cells, the table has {len(headers)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    out: str | os.PathLike[str],
    name: str,
    result: dict[str, Any],
    markdown: str | None = None,
    indent: int = 2,
) -> list[pathlib.Path]:
    """Write ``out/name.json`` (``result``, indented) and, if given, ``out/name.md``; return the paths."""
    directory = pathlib.Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.json"]
    paths[0].write_text(json.dumps(result, indent=indent) + "\n")
    if markdown is not None:
        paths.append(directory / f"{name}.md")
        paths[1].write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return paths


def _without_title(markdown: str) -> str:
    """``markdown`` without a leading ``# title`` line (the docs page has its own headings)."""
    if markdown.startswith("# "):
        markdown = markdown.split("\n", 1)[1] if "\n" in markdown else ""
    return markdown.strip()


@dataclasses.dataclass
class Report:
    """One benchmark run's output: ``<stem>.json``, ``<stem>.md``, the plots and the docs block.

    Attributes:
        stem: File name without extension (``--name`` where a benchmark has one).
        result: Everything measured; written as JSON.
        markdown: The tables (``None``: no ``.md``).
        command: The command that measured it (:func:`command_line`): the JSON's ``command`` key
            unless the result names it already, and a last line of the markdown unless it holds it.
        plot: Writes the figures (:data:`PlotFn`); ``None``: no plot.
        block: The docs page block this benchmark fills with ``--docs`` (``None``: none).
        docs_text: What goes into the block (default: ``markdown`` without its title line).
        indent: JSON indentation.
    """

    stem: str
    result: dict[str, Any]
    markdown: str | None = None
    command: str | None = None
    plot: PlotFn | None = None
    block: DocsBlock | None = None
    docs_text: str | None = None
    indent: int = 2

    def write(self, out: pathlib.Path, docs: pathlib.Path | None = None) -> list[pathlib.Path]:
        """Write the files into ``out`` (and, with ``docs``, the block into its page); return the paths.

        Raises ``ValueError`` when ``docs`` is given and the benchmark has no block.
        """
        if docs is not None and self.block is None:
            raise ValueError(f"benchmark result {self.stem!r} has no docs block: run it without --docs")
        result, markdown = self.result, self.markdown
        if self.command is not None:
            if self.command not in json.dumps(result):
                result = {**result, "command": self.command}
            if markdown is not None and self.command not in markdown:
                markdown = f"{markdown.rstrip()}\n\nCommand: `{self.command}`\n"
        paths = write_results(out, self.stem, result, markdown, self.indent)
        images = self.plot(result, pathlib.Path(out), self.stem) if self.plot is not None else []
        paths += images
        if docs is not None and self.block is not None:
            text = self.docs_text if self.docs_text is not None else _without_title(markdown or "")
            paths.append(update_docs(docs, self.block, text, images))
        for path in paths:
            print(f"wrote {path}", flush=True)
        return paths
