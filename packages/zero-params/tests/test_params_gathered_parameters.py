"""GatheredParameters (modifier_rank semantics, ownership) and external parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from params_cases import reference_partition, run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, Topology

pytest_plugins = ("params_worlds",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))


def _modifier_rank(modifier):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref = [p.detach().clone() for p in model.parameters()]
    zp.partition(model, persistence_threshold=3)  # the last bias (3 elements) stays whole
    params = list(model.parameters())
    with zp.GatheredParameters(params, modifier_rank=modifier):
        statuses = [zp.state_of(p).status for p in params]
        with torch.no_grad():
            for p in params:
                p.fill_(float(rank + 1))  # every rank edits differently
    after = [zp.state_of(p).status for p in params]
    with zp.GatheredParameters(params):
        seen = [p.detach().clone() for p in params]
    want = ref if modifier is None else [torch.full_like(r, modifier + 1.0) for r in ref]
    values_ok = all(torch.equal(s, w) for s, w in zip(seen, want))
    shards_ok = all(
        torch.equal(zp.state_of(p).shard, reference_partition(w, world, rank)) for p, w in zip(params, want)
    )
    return statuses, after, values_ok, shards_ok


def test_modifier_rank_edits_reach_every_rank(dist, world):
    for statuses, after, values_ok, shards_ok in run(dist, world, _modifier_rank, 0):
        assert statuses == [zp.ParamStatus.AVAILABLE] * 4
        assert after == [zp.ParamStatus.NOT_AVAILABLE] * 3 + [zp.ParamStatus.AVAILABLE]
        assert values_ok and shards_ok
    if world > 1:
        for _, _, values_ok, shards_ok in run(dist, world, _modifier_rank, world - 1):
            assert values_ok and shards_ok


def test_edits_without_modifier_rank_are_discarded(dist, world):
    for _, after, values_ok, shards_ok in run(dist, world, _modifier_rank, None):
        assert after == [zp.ParamStatus.NOT_AVAILABLE] * 3 + [zp.ParamStatus.AVAILABLE]
        assert values_ok and shards_ok  # the persistent bias is restored too


def _ownership():
    model = _model()
    weight, bias = model[0].weight, model[0].bias
    zp.partition(model)
    plain = nn.Parameter(torch.ones(2))
    with CommLedger(Topology()) as ledger:
        zp.gather([weight]).wait()
        with zp.GatheredParameters(weight):  # already whole: not gathered, not released
            inner = zp.state_of(weight).status
        kept = zp.state_of(weight).status
        with zp.GatheredParameters([bias, plain, bias]):  # duplicates and a plain parameter
            bias_in = zp.state_of(bias).status
            plain_ok = torch.equal(plain, torch.ones(2))
        bias_out = zp.state_of(bias).status
        with zp.GatheredParameters(bias, enabled=False):
            disabled = zp.state_of(bias).status
    zp.release([weight])
    errors = []
    for r in (-1, dist.get_world_size(), 99):
        try:
            with zp.GatheredParameters([weight], modifier_rank=r):
                pass
        except ValueError as e:
            errors.append(str(e))
    return inner, kept, bias_in, bias_out, disabled, plain_ok, ledger.count(op="all_gather"), errors


def test_gathered_parameters_owns_only_what_it_gathered(dist, world):
    for inner, kept, bias_in, bias_out, disabled, plain_ok, gathers, errors in run(dist, world, _ownership):
        assert inner == kept == zp.ParamStatus.AVAILABLE
        assert bias_in == zp.ParamStatus.AVAILABLE and bias_out == zp.ParamStatus.NOT_AVAILABLE
        assert disabled == zp.ParamStatus.NOT_AVAILABLE and plain_ok
        assert gathers == 2
        assert len(errors) == 3
        for r, message in zip((-1, world, 99), errors):
            assert f"modifier_rank={r}" in message and f"size {world}" in message


def _external():
    model = _model()
    zp.partition(model)
    head, shared = model[1], model[0].weight
    before = zp.external_parameters(head)
    zp.register_external_parameter(head, shared)
    zp.register_external_parameter(head, shared)  # idempotent
    registered = zp.external_parameters(head)
    with zp.GatheredParameters(model[0].bias, fwd_module=head):
        during = zp.external_parameters(head)
    after = zp.external_parameters(head)
    zp.unregister_external_parameter(head, shared)
    errors = []
    try:
        zp.unregister_external_parameter(head, shared)
    except ValueError as e:
        errors.append(str(e))
    try:
        zp.register_external_parameter(head, torch.zeros(2))
    except TypeError as e:
        errors.append(str(e))
    return (
        before == [],
        [p is shared for p in registered],
        [p is shared or p is model[0].bias for p in during],
        [p is shared for p in after],
        zp.external_parameters(head) == [],
        errors,
    )


def test_external_parameters_live_in_one_module_state(dist, world):
    empty, registered, during, after, cleared, errors = run(dist, world, _external)[0]
    assert empty and registered == [True] and during == [True, True] and after == [True] and cleared
    assert "not registered" in errors[0] and "nn.Parameter" in errors[1]
