"""Parameters built on the ``meta`` device become partitioned parameters without ever being whole.

Reference: the same module built plainly (values), the formula for the shard geometry
(``ceil(numel / world)`` zero-filled elements), and torch's own ``meta`` semantics.
"""

from __future__ import annotations

import pytest
import torch
from params_cases import run
from torch import nn

import zero_params as zp
from zero_params.partitioning import meta_target_device


class _Reinit(nn.Module):
    """A parent whose constructor re-initialises a child's weight after attaching it (like HF post_init)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3, bias=False)
        torch.manual_seed(11)
        nn.init.normal_(self.a.weight)
        nn.init.constant_(self.b.weight, 0.25)


def _meta_build(threshold: int) -> dict:
    with torch.device("meta"), zp.Init(param_persistence_threshold=threshold):
        model = _Reinit()
    states = {n: zp.state_of(p) for n, p in model.named_parameters()}
    geometry = {
        n: (tuple(s.shape), s.shard.numel(), s.shard.device.type, s.device.type, s.persistent, p.is_meta)
        for (n, s), p in zip(states.items(), model.parameters(), strict=True)
    }
    with zp.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(11)
    expected_a = nn.init.normal_(torch.empty(5, 7))
    return {
        "geometry": geometry,
        "a.weight": torch.equal(values["a.weight"], expected_a),
        "b.weight": torch.equal(values["b.weight"], torch.full((3, 5), 0.25)),
        "a.bias": torch.equal(values["a.bias"], torch.zeros(5)),  # never initialised: zeros
        "still_partitioned": all(
            zp.state_of(p).status is (zp.ParamStatus.AVAILABLE if zp.state_of(p).persistent else
                                      zp.ParamStatus.NOT_AVAILABLE)
            for p in model.parameters()
        ),
    }  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("threshold", [0, 5])
def test_meta_built_parameters_are_partitioned_zero_then_initialised_by_init_code(dist, world, threshold):
    dev = meta_target_device().type
    for r in run(dist, world, _meta_build, threshold):
        part = lambda n: -(-n // world)  # noqa: E731
        assert r["geometry"] == {
            "a.weight": ((5, 7), part(35), dev, dev, False, False),
            "a.bias": ((5,), part(5), dev, dev, threshold >= 5, False),
            "b.weight": ((3, 5), part(15), dev, dev, False, False),
        }
        assert r["a.weight"] and r["b.weight"] and r["a.bias"] and r["still_partitioned"], r


def _partition_meta_directly() -> tuple[int, bool, str]:
    with torch.device("meta"):
        lin = nn.Linear(1023, 3)
    before = id(lin.weight)
    zp.partition(lin)
    weight = lin.weight
    with zp.GatheredParameters([weight]):
        zeros = bool((weight == 0).all()) and weight.shape == (3, 1023)
    sparse = nn.Parameter(torch.zeros(4, 4).to_sparse())
    try:
        zp.partition([("sparse", sparse)])
        msg = ""
    except TypeError as exc:
        msg = str(exc)
    return int(id(weight) == before), zeros, msg


def test_partition_accepts_meta_keeps_identity_and_still_refuses_sparse(dist):
    same, zeros, msg = run(dist, 2, _partition_meta_directly)[0]
    assert same == 1 and zeros
    assert "parameter 'sparse': cannot partition a non-strided" in msg
