"""What a test function running on a rank observed, as plain values it can return to the test.

Inside a rank, pytest's ``caplog`` and ``pytest.raises`` do not reach: :func:`captured_logs`
collects a logger's messages and :func:`raised_message` turns an expected error into its message.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["captured_logs", "raised_message"]


class _Collect(logging.Handler):
    """Keeps the formatted message of every record it is handed."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.NOTSET)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured_logs(name: str, level: int | None = None) -> Iterator[list[str]]:
    """The messages the logger ``name`` (and its children) emit inside the ``with`` block, in order.

    ``level``: the logger's level meanwhile (e.g. ``logging.INFO`` to see INFO messages of a
    logger that inherits WARNING), restored after; ``None`` leaves it as it is. The list stays
    valid after the block::

        with captured_logs("zero.engine", logging.INFO) as messages:
            engine.step()
        assert any("skipped" in m for m in messages)
    """
    logger = logging.getLogger(name)
    messages: list[str] = []
    handler = _Collect(messages)
    saved = logger.level
    if level is not None:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def raised_message(
    error: type[BaseException], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> str | None:
    """``str()`` of the ``error`` that ``fn(*args, **kwargs)`` raises; ``None`` when it returns.

    Any other exception propagates (the test fails with it).
    """
    try:
        fn(*args, **kwargs)
    except error as exc:
        return str(exc)
    return None
