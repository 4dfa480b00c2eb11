"""How the integration tests share pytest-xdist workers (``--dist loadgroup --no-loadscope-reorder``).

A file's tests stay together on one worker (one group per file), so a module fixture that trains
a reference runs once; the files whose tests are independent programs (:data:`ONE_BY_ONE`) are
handed out test by test. Work goes out in collection order, which this hook sets: the longest
files first (:data:`LONGEST_FIRST`, from the CI log's durations), then the other files, then the
one-by-one tests, which fill in while the last long file runs on the other worker. Without
xdist the order changes nothing.
"""

from __future__ import annotations

import pytest

# Files in the order their work is handed out: the longest first.
LONGEST_FIRST = (
    "test_integration_trainers.py",
    "test_integration_trainer_memory.py",
    "test_integration_fabric.py",
    "test_integration_mics.py",
    "test_integration_zeropp.py",
    "test_integration_cluster.py",
    "test_integration_pretrained.py",
    "test_integration_zeropp_hpz_memory.py",
    "test_integration_gpu_check.py",
)
# Files whose tests each run their own programs and share no fixture.
ONE_BY_ONE = ("test_integration_deepspeed_scripts.py", "test_integration_docs.py")


def _file(item: pytest.Item) -> str:
    return item.path.name


def _order(item: pytest.Item) -> tuple[int, int]:
    name = _file(item)
    if name in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(name))
    return (2, ONE_BY_ONE.index(name)) if name in ONE_BY_ONE else (1, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group each file's tests (but :data:`ONE_BY_ONE`'s) and put the work in hand-out order."""
    for item in items:
        if _file(item) not in ONE_BY_ONE:
            item.add_marker(pytest.mark.xdist_group(_file(item)))
    items.sort(key=_order)  # stable: a file's tests keep their order
