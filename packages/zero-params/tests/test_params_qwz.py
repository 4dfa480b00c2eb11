"""qwZ: a partitioned model gathered through zero-comm's int8 quantized all-gather strategy."""

from __future__ import annotations

import torch
from params_cases import run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, Topology
from zero_comm.quantized import QuantizedAllGather
from zero_kernels import QuantConfig

pytest_plugins = ("params_worlds",)

GROUP = 64  # small quantization groups so the odd-sized parameters span several


def _qwz():
    topo = Topology()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 131))  # numel 91, 7, 917, 131
    ref = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    strategy = QuantizedAllGather(config=QuantConfig(bits=8, group_size=GROUP))
    zp.partition(model, gather_strategy=strategy)
    with CommLedger(topo) as ledger:
        zp.gather(params).wait()
    errors = [(p.detach() - r).abs().max().item() for p, r in zip(params, ref)]
    absmax = [r.abs().max().item() for r in ref]
    shapes_ok = all(p.shape == r.shape for p, r in zip(params, ref))
    exact = all(torch.equal(p, r) for p, r in zip(params, ref))
    zp.release(params)
    return dict(
        errors=errors,
        absmax=absmax,
        shapes_ok=shapes_ok,
        exact=exact,
        calls=ledger.count(),
        quantized_calls=ledger.count(op="quantized_all_gather"),
        world=topo.world_size,
    )


def test_quantized_gather_strategy_stays_within_the_int8_bound(dist, world):
    """One quantized collective for the whole model; every value within absmax/2^7 of the original
    (the per-group bound is A/2^8, A/2^7 at a clamped top code; A <= the tensor's absmax)."""
    for r in run(dist, world, _qwz):
        assert r["shapes_ok"]
        assert r["calls"] == 1
        for err, amax in zip(r["errors"], r["absmax"]):
            assert err <= amax / 2**7 + 1e-7, (err, amax)
        if r["world"] > 1:
            assert r["quantized_calls"] == 1
            assert not r["exact"]  # the values really went through int8
