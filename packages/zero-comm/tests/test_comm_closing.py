"""The one ``with`` protocol of closable objects (the watchdog, the engine, ...)."""

from __future__ import annotations

import pytest

from zero_comm.closing import ClosesOnExit


class _Held(ClosesOnExit):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_with_returns_the_object_and_closes_it_whether_or_not_the_block_raised():
    with _Held() as held:
        assert held.closed == 0
    assert held.closed == 1
    with pytest.raises(ValueError, match="inside"), _Held() as failed:
        raise ValueError("inside")
    assert failed.closed == 1


def test_a_class_without_close_cannot_be_built():
    class NoClose(ClosesOnExit):
        pass

    with pytest.raises(TypeError, match="close"):
        NoClose()
