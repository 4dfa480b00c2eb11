"""The benchmark helpers are scripts' modules, not a package: put ``benchmarks/`` on the path."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
