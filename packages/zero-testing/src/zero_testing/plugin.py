"""pytest plugin: the session-wide ``dist`` fixture (a :class:`PoolRegistry`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zero_testing.pool import PoolRegistry


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolRegistry]:
    """Run a function on N gloo ranks: ``dist.run(4, fn, arg, ranks_per_node=2)``.

    The file store of each pool lives under pytest's session temp directory.
    """
    registry = PoolRegistry(tmp_path_factory.mktemp("zero-dist"))
    yield registry
    registry.close()
