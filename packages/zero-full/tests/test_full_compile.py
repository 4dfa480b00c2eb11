"""torch.compile on the engine: parity with eager at world 2, and the errors where it cannot work.

CPU inductor compiles are slow (tens of seconds on a loaded machine): the model is tiny and
trains two steps; stages 1 and 2 (no module hooks) compile with the ``aot_eager`` backend,
which runs the same dynamo + autograd tracing without inductor's code generation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_full

BATCH = 8
STEPS = 2


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 3)

    def forward(self, x, y):
        return ((self.b(torch.tanh(self.a(x))) - y) ** 2).mean()


def _config(stage):
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(rank, stage, backend):
    # one inductor compile thread: no worker pool to start on a small, loaded machine
    with torch._inductor.config.patch(compile_threads=1):
        return _train_steps(rank, stage, backend)


def _train_steps(rank, stage, backend):
    world, r = rank.world_size, rank.rank
    model = Tiny()
    engine = zero_full.initialize(model, _config(stage), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    if backend is not None:
        engine.compile(backend=backend)
    losses = []
    n = BATCH // world
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 3, generator=g)
            loss = engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        with zero_full.GatheredParameters(list(model.parameters())):
            params = {k: p.detach().clone() for k, p in model.named_parameters()}
        compiled = model._compiled_call_impl is not None
    finally:
        engine.close()
        torch._dynamo.reset()
    return losses, params, compiled


@pytest.mark.parametrize(
    "stage,backend",
    # inductor at stage 3 (module hooks inside the graph) is part of the smoke set on every torch
    [pytest.param(3, "inductor", marks=pytest.mark.smoke), (1, "aot_eager"), (2, "aot_eager")],
)
def test_a_compiled_model_trains_like_eager(dist, stage, backend):
    eager = dist.run(2, _train, stage, None)
    compiled = dist.run(2, _train, stage, backend)
    for (le, pe, _), (lc, pc, was_compiled) in zip(eager, compiled):
        assert was_compiled
        # The project's yardstick for fp32 against a reference run (zero_testing.compare): each
        # step's loss within 1e-5 of its value, each parameter within 1e-5 of its largest magnitude.
        for a, b in zip(le, lc):
            assert abs(a - b) <= 1e-5 * abs(a)
        for k in pe:
            assert (pe[k] - pc[k]).abs().max() <= 1e-5 * pe[k].abs().max(), k


def _refusals(rank):
    messages = []
    try:
        zero_full.initialize(torch.compile(Tiny()), _config(3))
    except TypeError as exc:
        messages.append(str(exc))
    engine = zero_full.initialize(Tiny(), _config(3))
    try:
        engine.compile(fullgraph=True)
    except ValueError as exc:
        messages.append(str(exc))
    engine.close()
    return messages


def test_compiling_before_initialize_or_fullgraph_under_stage3_is_refused(dist):
    before, fullgraph = dist.run(1, _refusals)[0]
    assert "engine.compile" in before and "OptimizedModule" in before
    assert "fullgraph=True cannot work under ZeRO stage 3" in fullgraph
