"""The ``zero`` command line."""

from zero_full.cli.main import main

__all__ = ["main"]
