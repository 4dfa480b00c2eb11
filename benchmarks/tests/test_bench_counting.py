"""``benchmarks.kit.impls``: the ZeRO formulas and model-state bytes counted from storages."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.kit.impls import (
    formula_state_bytes,
    reachable_tensors,
    ring_ideal_bytes,
    stage_of,
    storage_bytes,
)


def test_formulas_per_stage():
    psi, n = 1000, 4
    assert [stage_of(i) for i in ("single", "ddp", "fsdp2", "zero-1", "deepspeed-2", "zero-3")] == [
        0,
        0,
        3,
        1,
        2,
        3,
    ]
    assert [stage_of(i) for i in ("zero-3-compiled", "zero-3-unset", "zero-3-dsdefaults")] == [3, 3, 3]
    assert formula_state_bytes("ddp", psi, n) == 16 * psi
    assert formula_state_bytes("zero-1", psi, n) == 8 * psi + 8 * psi / n
    assert formula_state_bytes("deepspeed-2", psi, n) == 4 * psi + 12 * psi / n
    assert formula_state_bytes("zero-3", psi, n) == formula_state_bytes("fsdp2", psi, n) == 16 * psi / n
    assert formula_state_bytes("single", psi, n) == 16 * psi
    assert ring_ideal_bytes("ddp", psi, n) == ring_ideal_bytes("zero-2", psi, n) == 2 * psi * 3 / 4 * 4
    assert ring_ideal_bytes("zero-3", psi, n) == ring_ideal_bytes("fsdp2", psi, n) == 3 * psi * 3 / 4 * 4
    assert ring_ideal_bytes("single", psi, n) == 0 and ring_ideal_bytes("zero-3", psi, 1) == 0


def test_adamw_model_states_are_16_bytes_per_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 7)).sum().backward()
    opt.step()  # creates exp_avg and exp_avg_sq; grads still attached
    tensors = reachable_tensors([model, opt])
    # params + grads + two moments; the step counters are 0-d float tensors (4 bytes each)
    steps = len(opt.state)
    assert storage_bytes(tensors) == 16 * psi + 4 * steps


def test_views_and_shared_storages_count_once():
    flat = torch.zeros(100)
    a, b = flat[:40], flat[40:].view(6, 10)
    holder = {"a": a, "b": [b, (a,)], "again": flat}
    assert storage_bytes(reachable_tensors([holder])) == 400
    assert storage_bytes([torch.empty(0), torch.zeros(3, dtype=torch.float64)]) == 24


def test_tensors_reached_through_slots_hooks_and_attributes():
    class Slotted:
        __slots__ = ("t",)

        def __init__(self) -> None:
            self.t = torch.zeros(10)

    class Owner:
        def __init__(self) -> None:
            self.kept = Slotted()

        def hook(self) -> None:
            pass

    param = nn.Parameter(torch.zeros(5))
    param.extra = torch.zeros(20)  # an attribute a library attached to a parameter
    owner = Owner()
    found = reachable_tensors([{"hook": owner.hook}, param])
    assert storage_bytes(found) == 4 * (10 + 5 + 20)
