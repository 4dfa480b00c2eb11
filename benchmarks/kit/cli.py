"""The one command line of every benchmark: :class:`BenchmarkParser`.

Every benchmark's parser starts from :func:`benchmark_parser`, which adds the common options:

* ``--out DIR``: where the result files go (default ``benchmarks/results``);
* ``--docs DIR``: also put the tables and plots into the docs page block the benchmark owns
  (only benchmarks with a block have it);
* ``--quick``: the benchmark's smallest settings (a smoke run); options given explicitly win.

Integer options are declared as keywords (``new_tokens=64`` is ``--new-tokens``, default 64);
the benchmark adds its other options to what it returns. A benchmark with many of them keeps them,
and what ``--quick`` sets, in two one-line mappings beside its ``build_parser``
(``DEFAULTS = dict(world=2, new_tokens=64)``, ``QUICK = dict(new_tokens=8)``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BenchmarkParser", "benchmark_parser"]

DEFAULT_OUT = pathlib.Path("benchmarks/results")


class BenchmarkParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``--quick`` puts the benchmark's quick settings in as defaults."""

    def __init__(self, name: str, description: str, quick: Mapping[str, Any]) -> None:
        super().__init__(prog=f"python -m benchmarks {name}", description=description)
        self.benchmark = name
        self.quick = dict(quick)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if "--quick" not in argv or not self.quick:
            return super().parse_known_args(argv, namespace)
        unknown = sorted(set(self.quick) - {action.dest for action in self._actions})
        if unknown:
            raise ValueError(f"benchmark {self.benchmark!r}: quick settings name no option: {unknown}")
        saved = {dest: self.get_default(dest) for dest in self.quick}
        self.set_defaults(**self.quick)
        try:
            return super().parse_known_args(argv, namespace)
        finally:
            self.set_defaults(**saved)


def benchmark_parser(
    name: str,
    doc: str,
    *,
    quick: Mapping[str, Any] | None = None,
    docs: bool = False,
    out: pathlib.Path | None = DEFAULT_OUT,
    **ints: int | None,
) -> BenchmarkParser:
    """A benchmark's parser: ``doc``'s first line, an integer option per keyword and the common options.

    Args:
        name: The registered name (the usage line reads ``python -m benchmarks <name>``).
        doc: The benchmark's module docstring (its first line describes it).
        quick: Option destinations and values ``--quick`` sets (``{"repeats": 2}``).
        docs: Whether the benchmark fills a docs block (adds ``--docs``).
        out: ``--out``'s default (``None``: print only, unless ``--out`` is given).
    """
    parser = BenchmarkParser(name, doc.strip().splitlines()[0], quick or {})
    for option, default in ints.items():
        parser.add_argument("--" + option.replace("_", "-"), type=int, default=default)
    parser.add_argument("--out", type=pathlib.Path, default=out, help=f"result directory (default {out})")
    if docs:
        parser.add_argument(
            "--docs", type=pathlib.Path, default=None, help="docs directory: also fill this benchmark's block"
        )
    settings = ", ".join(f"{k}={v}" for k, v in (quick or {}).items()) or "the defaults"
    parser.add_argument("--quick", action="store_true", help=f"smallest settings, a smoke run ({settings})")
    return parser
