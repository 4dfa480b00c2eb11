"""Every control-plane exchange builds its tensors on the device the process group serves.

The proxy for an NCCL group on a CPU-only machine: torch's fake backend registered for the
``cuda`` device type only (``init_process_group("cuda:fake")``, world 2 in one process, no
data moves). Like NCCL it has no backend for the CPU: a CPU tensor in one of its collectives
raises ``No backend type associated with device type cpu``. An exchange that chose the
group's device instead asks for a CUDA tensor, which a CPU-only torch refuses with "not
compiled with CUDA" — the observable proof that it went to the served device. What runs on
the device itself is for the GPU check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from zero_comm import CommWatchdog
from zero_full import ZeroConfig
from zero_full.checkpoint.collectives import exchange
from zero_full.config.robustness import NonFinitePolicy
from zero_full.guards.agreement import check_agreement, exchange_json
from zero_full.guards.nonfinite import NonFiniteGuard
from zero_optim import found_overflow, global_grad_norm

_WRONG_DEVICE = "No backend type associated with device type cpu"


@pytest.fixture
def cuda_only_group():
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _reaches_for_the_served_device(fn) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message says which device the exchange chose
        message = str(exc)
    else:
        message = ""
    assert _WRONG_DEVICE not in message  # what every one of these raised with CPU tensors
    if not torch.cuda.is_available():  # a CPU build, or a CUDA build on a machine without a driver
        assert "not compiled with CUDA" in message or "no NVIDIA driver" in message, message


def _watchdog_path_check() -> None:
    with CommWatchdog(dist.HashStore(), 0, 2, timeout=5, heartbeat_interval=1) as wd:
        wd.check_same_path("all_gather", 1, None)


@pytest.mark.parametrize(
    "exchange_of",
    [
        pytest.param(lambda: exchange_json({"rank": 0}), id="json-exchange"),
        pytest.param(
            lambda: check_agreement(nn.Linear(3, 2), ZeroConfig.coerce({"zero_optimization": {"stage": 1}})),
            id="rank-agreement",
        ),
        pytest.param(_watchdog_path_check, id="watchdog-path-check"),
        pytest.param(lambda: exchange({"ok": True}, 5.0), id="checkpoint-status"),
        pytest.param(
            lambda: NonFiniteGuard(NonFinitePolicy.SKIP).handle(SimpleNamespace(groups=[]), 0),
            id="nonfinite-culprit",
        ),
        pytest.param(lambda: found_overflow([]), id="nonfinite-flag"),
        pytest.param(lambda: global_grad_norm([]), id="grad-norm"),
    ],
)
def test_control_plane_exchanges_use_the_groups_device(cuda_only_group, exchange_of):
    _reaches_for_the_served_device(exchange_of)
