"""``zero_comm.launch`` re-exports the launcher of zero-launch, warning where it moved."""

from __future__ import annotations

import pytest

import zero_launch


@pytest.mark.parametrize("name", zero_launch.__all__)
def test_each_name_is_the_zero_launch_one_with_a_deprecation_warning(name):
    import zero_comm.launch as moved

    with pytest.warns(DeprecationWarning, match=f"zero_comm.launch.{name} moved to the zero-launch package"):
        found = getattr(moved, name)
    assert found is getattr(zero_launch, name)


def test_an_unknown_name_is_an_attribute_error():
    import zero_comm.launch as moved

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        moved.nothing  # noqa: B018
