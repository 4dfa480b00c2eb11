"""Models, batches and optimizers shared by the zero-optim tests (imported by the spawned ranks too)."""

from __future__ import annotations

import torch
from torch import nn

import zero_params

# Parameter shapes of every odd kind: numel 0, 1, a prime, a matrix, 1023, and one smaller than the world.
SHAPES = [(0,), (1,), (7,), (3, 5), (1023,), (13, 11), (2,)]


class OddParams(nn.Module):
    """One parameter of each of :data:`SHAPES` (seeded: every rank builds the same values)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in SHAPES)


class Odd(OddParams):
    """:class:`OddParams` plus a ``Linear(5, 3)`` on the first five features of a ``(rows, 6)`` batch.

    ``unused``: also a ``Linear(2, 2)`` that never gets a gradient (reduced as zeros).
    """

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 3)
        if unused:
            self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.inner(x[:, :5]).pow(2).mean()
        for i, p in enumerate(self.ps):
            total = total + ((p * (i + 1) - x.mean()) ** 2).mean() + p.sum() ** 2 * 1e-3
        return total


def batch(step: int, micro: int, world: int) -> torch.Tensor:
    """The whole batch of micro-step ``micro`` of ``step``: 4 rows per rank, 6 features."""
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(4 * world, 6, generator=g)


def make_optimizer(kind: str):
    """A torch optimizer factory: ``"sgd"`` (momentum) or AdamW with two parameter groups."""
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(
        [{"params": ps[:4], "lr": 1e-2}, {"params": ps[4:], "weight_decay": 0.1}], lr=3e-3
    )


def micro_step(model: nn.Module, sink, x: torch.Tensor) -> None:
    """Forward/backward with every parameter gathered; hand gradients to the sink like the hooks do."""
    params = list(model.parameters())
    zero_params.gather(params).wait()
    model(x).backward()
    for p in reversed(params):
        sink.on_grad_ready(p)
    sink.on_backward_end()
    zero_params.release(params)


def reference_run(model: nn.Module, kind: str, steps: int, accumulate: int, world: int, mean_micro: bool):
    """``model`` trained by a torch optimizer in one process on the whole batch: the reference.

    A micro-step's loss is the mean of the ``world`` rank slices' losses (and, with ``mean_micro``,
    divided by ``accumulate``: the mean over the micro-steps rather than their sum). Returns the
    final parameters by name.
    """
    opt = make_optimizer(kind)(list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(steps):
        for micro in range(accumulate):
            x = batch(step, micro, world)
            loss = sum(model(x[4 * r : 4 * (r + 1)]) for r in range(world)) / world
            (loss / accumulate if mean_micro else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {n: p.detach() for n, p in model.named_parameters()}


def step_published(opt, during: bool) -> None:
    """One optimizer step: ``opt.step()`` (which publishes while it steps) if ``during``; else the
    reference, the stepper over the whole partition and then ``publish_updated_shards``."""
    if during:
        opt.step()
        return
    with torch.no_grad():
        opt.stepper.step()
    opt.publish_updated_shards()


def flat_state(opt) -> dict:
    """Copies of the optimizer's flat masters (``"master"``) and its tensor state (``"moments"``,
    keyed ``"<group>.<name>"``), from ``opt.state_dict()``."""
    state = opt.state_dict()
    return {
        "master": [m.clone() for m in state["master"]],
        "moments": {
            f"{i}.{k}": v.clone()
            for i, s in state["torch_optimizer"]["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        },
    }


def assert_same_results(during: list[dict], after: list[dict], named: tuple[str, ...]) -> None:
    """Per rank, the ``named`` dicts of tensors, the masters and the moments equal bit for bit."""
    for rank, (a, b) in enumerate(zip(during, after, strict=True)):
        for key in (*named, "moments"):
            assert a[key].keys() == b[key].keys()
            for n in a[key]:
                assert torch.equal(a[key][n], b[key][n]), f"rank {rank}: {key} {n} differs"
        for x, y in zip(a["master"], b["master"], strict=True):
            assert torch.equal(x, y), f"rank {rank}: master differs"
