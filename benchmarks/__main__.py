"""``python -m benchmarks list`` | ``python -m benchmarks <name> [options]`` (``<name> --help``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks.registry import BENCHMARKS, find, load

USAGE = "usage: python -m benchmarks {list | <name> [options]}  (python -m benchmarks <name> --help)"


def main(argv: Sequence[str]) -> int:
    """Dispatch ``argv`` (the arguments after ``-m benchmarks``); returns the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "list":
        width = max(len(b.name) for b in BENCHMARKS)
        for bench in BENCHMARKS:
            print(f"{bench.name:<{width}}  {bench.summary}")
        return 0
    try:
        find(argv[0])
    except KeyError as exc:
        print(f"{exc.args[0]}\n{USAGE}", file=sys.stderr)
        return 2
    load(argv[0]).main(list(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
