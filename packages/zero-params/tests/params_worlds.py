"""pytest plugin of the zero-params tests: the session-scoped ``world`` fixture.

Load it with ``pytest_plugins = ("params_worlds",)`` in a test module.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", params=[1, 2, 4], ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest) -> int:
    """World size, session-scoped so that pytest runs all tests of one world size together
    (each pool of ranks is started once; starting 4 ranks costs ~20 s on 2 cores). Tests do
    not narrow it with an indirect parametrize: pytest would then group them by parameter
    index, not value, and restart pools; a test whose property needs several ranks or nodes
    asserts it at the world sizes where it applies."""
    return request.param
