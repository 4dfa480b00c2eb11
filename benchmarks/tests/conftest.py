"""The benchmarks are the ``benchmarks`` package at the repository root: put the root on the path."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
