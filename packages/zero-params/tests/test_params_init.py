"""Init: same weights as a plain build (incl. post-construction re-inits), bounded memory, scoping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from params_cases import StorageTracker, reference_partition, run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, Topology

pytest_plugins = ("params_worlds",)


class Custom(nn.Module):
    """Re-initialises its children after they exist (as HF ``post_init`` does), reading values."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 9, padding_idx=3)
        self.conv = nn.Conv2d(2, 4, 3)
        self.lin = nn.Linear(9, 9)
        self.head = nn.Linear(9, 11, bias=False)
        self.scale = nn.Parameter(torch.ones(9))
        self.post_init()

    def post_init(self) -> None:
        nn.init.xavier_uniform_(self.lin.weight)  # fan from dim() / size(): full shape needed
        nn.init.trunc_normal_(self.head.weight, std=0.02)  # normal_, then reads and copy_
        self.lin.weight.data.mul_(0.5)  # .data alias, read-modify-write: gathered
        with torch.no_grad():
            self.emb.weight[self.emb.padding_idx].zero_()  # write through a view
            self.lin.bias.copy_(self.head.weight[0] * 2)  # overwrite from another parameter
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_out")  # 4-D fan computation
        if tuple(self.conv.weight.shape) != (4, 2, 3, 3) or self.lin.weight.numel() != 81:
            raise AssertionError(f"shape queries see {self.conv.weight.shape} / {self.lin.weight.numel()}")
        self.head.weight = self.emb.weight  # tie
        self.scale.data.fill_(0.5)
        self.lin.extra = nn.Parameter(torch.randn(5, 2))  # on a module already attached: partitioned now
        with torch.no_grad():
            self.lin.extra.mul_(3)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=257, n_positions=32)
    return GPT2LMHeadModel(config)


BUILDERS = {
    "mlp": lambda: nn.Sequential(nn.Linear(13, 31), nn.ReLU(), nn.Linear(31, 7), nn.LayerNorm(7)),
    "conv": lambda: nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Conv1d(5, 2, 1, bias=False)),
    "custom": Custom,
    "gpt2": _gpt2,
}


def _init_matches_plain(kind, threshold):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234)
    plain = BUILDERS[kind]()
    after_plain = torch.rand(3)
    torch.manual_seed(1234)
    with CommLedger(Topology()) as ledger, zp.Init(param_persistence_threshold=threshold):
        model = BUILDERS[kind]()
    after_init = torch.rand(3)
    names = [n for n, _ in model.named_parameters()]
    partitioned = all(zp.is_partitioned(p) for p in model.parameters())
    state_names = [zp.state_of(p).name for p in model.parameters()]
    whole = [n for n, p in model.named_parameters() if not zp.state_of(p).persistent and p.numel() != 0]
    plain_params = dict(plain.named_parameters())
    bad_shards = [
        n
        for n, p in model.named_parameters()
        if not torch.equal(zp.state_of(p).shard, reference_partition(plain_params[n].detach(), world, rank))
    ]
    with zp.GatheredParameters(list(model.parameters())):
        bad_values = [n for n, p in model.named_parameters() if not torch.equal(p, plain_params[n])]
    return (
        names == list(plain_params),
        partitioned,
        names == state_names,
        whole,
        bad_shards,
        bad_values,
        torch.equal(after_plain, after_init),
        ledger.count(),
    )


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_init_builds_the_plain_weights_bit_exactly(dist, world, kind):
    for threshold in (0, 64):
        for same_names, partitioned, named, whole, bad_shards, bad_values, rng, collectives in run(
            dist, world, _init_matches_plain, kind, threshold
        ):
            assert same_names and partitioned and named
            assert whole == []  # nothing left whole after Init except persistent parameters
            assert bad_shards == [] and bad_values == []
            assert rng  # the RNG stream advanced exactly as in the plain build
            # overwriting inits need no communication; only Custom's reads of partitioned values do
            assert (collectives > 0) if kind == "custom" else (collectives == 0)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)


def _stack() -> nn.Module:
    return nn.Sequential(*[Block(40) for _ in range(8)])


MEMORY_MODELS = {"stack": _stack, "gpt2": _gpt2}


def _construction_memory(kind):
    """Peak live storage bytes while building ``kind`` plainly and under Init.

    A census of the plain build (a parameter-registration hook) gives every parameter
    ever constructed — including ones dropped later, e.g. GPT-2's untied ``lm_head``
    weight — and the largest set of parameters registered on one module.
    """
    from torch.nn.modules.module import register_module_parameter_registration_hook

    world = dist.get_world_size()
    built: dict[int, torch.Tensor] = {}
    per_module: dict[int, int] = {}

    def census(module, name, param):
        if param is not None and id(param) not in built:
            built[id(param)] = param
            per_module[id(module)] = per_module.get(id(module), 0) + param.numel() * param.element_size()

    build = MEMORY_MODELS[kind]
    torch.manual_seed(0)
    hook = register_module_parameter_registration_hook(census)
    try:
        with StorageTracker() as plain_tracker:
            plain = build()
    finally:
        hook.remove()
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in plain.buffers())
    shard_bytes = sum(-(-p.numel() // world) * p.element_size() for p in built.values())
    largest_module = max(per_module.values())
    del plain
    built.clear()
    torch.manual_seed(0)
    with StorageTracker() as init_tracker:
        with zp.Init():
            model = build()
    live_after = init_tracker.live
    del model
    return (
        model_bytes,
        buffer_bytes,
        largest_module,
        shard_bytes,
        plain_tracker.peak,
        init_tracker.peak,
        live_after,
    )


@pytest.mark.parametrize("kind", list(MEMORY_MODELS))
def test_init_never_holds_more_than_a_shard_plus_one_module(dist, world, kind):
    for model_bytes, buffers, largest, shards, plain_peak, init_peak, live_after in run(
        dist, world, _construction_memory, kind
    ):
        bound = shards + largest + buffers  # S/world + padding + the largest module's own parameters
        assert plain_peak >= model_bytes  # the tracker sees a plain build hold the whole model
        if world == 4:
            assert bound < 0.5 * model_bytes  # the bound is meaningful for this model
        assert init_peak <= bound, (init_peak, bound, model_bytes)
        assert live_after <= shards + buffers  # only shards (and buffers) remain


def _scoping():
    outside = nn.Linear(3, 3)
    with zp.Init(enabled=False):
        disabled = nn.Linear(3, 3)
    with zp.Init():
        built = nn.Sequential(nn.Linear(4, 6))
        wrapper = nn.Sequential(outside)  # built outside, attached inside: untouched
        shape_inside = tuple(built[0].weight.shape)
        numel_inside = built[0].weight.numel()
        with zp.Init(param_persistence_threshold=100):
            inner = nn.Linear(5, 5)  # 25 + 5 <= 100: the inner Init's settings apply
        outer = nn.Linear(20, 20)
    with zp.Init(dtype=torch.float64):
        torch.manual_seed(5)
        doubled = nn.Linear(5, 3)
    torch.manual_seed(5)
    ref = nn.Linear(5, 3).weight.detach().double()
    with zp.GatheredParameters(doubled.weight):
        double_ok = doubled.weight.dtype == torch.float64 and torch.equal(doubled.weight, ref)
    return dict(
        outside=zp.is_partitioned(wrapper[0].weight),
        disabled=zp.is_partitioned(disabled.weight),
        built=zp.is_partitioned(built[0].weight),
        shape_inside=shape_inside,
        numel_inside=numel_inside,
        shape_outside=tuple(built[0].weight.shape),
        full_shape=tuple(zp.full_shape(built[0].weight)),
        inner=zp.state_of(inner.weight).persistent,
        outer=zp.state_of(outer.weight).persistent,
        double_ok=double_ok,
    )


def test_init_scoping_nesting_and_shape_queries(dist, world):
    for r in run(dist, world, _scoping):
        assert not r["outside"] and not r["disabled"] and r["built"]
        assert r["shape_inside"] == (6, 4) and r["numel_inside"] == 24
        assert r["shape_outside"] == (0,) and r["full_shape"] == (6, 4)
        assert r["inner"] and not r["outer"]
        assert r["double_ok"]
