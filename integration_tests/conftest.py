"""How the integration tests are spread over pytest-xdist workers (``-n N --dist loadgroup``).

Most tests are spread one by one: many of them wait (a rank start-up, a comm_timeout, torchrun's
grace period, a shaped link) while another worker's test computes. The tests of a file whose
module-scoped fixture is itself a training run (a reference run, DeepSpeed's checkpoints, saved
Hugging Face checkpoints) stay on one worker, so that fixture runs once. Without xdist nothing
changes.
"""

from __future__ import annotations

import pytest

# Files whose module-scoped fixture trains: one xdist group each.
ONE_WORKER = (
    "test_integration_checkpoint_faults",
    "test_integration_deepspeed_checkpoint",
    "test_integration_pretrained",
    "test_integration_trainers",
    "test_integration_zeropp",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.path.stem in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
