"""Models, sinks and helpers shared by the zero-coord tests (imported by the spawned ranks too)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.distributed as tdist
from torch import nn

import zero_params
from zero_coord import Coordinator, CoordinatorConfig

# Session scope makes pytest run every test of one world size together, so pooled ranks are reused.
WORLDS = [pytest.param(1, id="w1"), pytest.param(2, id="w2"), pytest.param(4, id="w4")]
over_worlds = pytest.mark.parametrize("world", WORLDS, scope="session")


# ---------------------------------------------------------------------------- models


class TiedHead(nn.Module):
    """Output layer reading the embedding weight (an external parameter) plus its own bias."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self._tied = (embed,)  # a tuple: not registered as a submodule
        self.bias = nn.Parameter(torch.randn(embed.num_embeddings) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self._tied[0].weight.t() + self.bias


class TiedBranchModel(nn.Module):
    """Tied weights three ways, a frozen layer, an empty parameter and a branch chosen per call.

    * ``head`` reads ``embed.weight`` in its forward (registered as an external parameter);
    * ``out`` owns the very same parameter object (``out.weight is embed.weight``);
    * ``frozen`` has ``requires_grad=False``; ``empty`` has 0 elements (persistent);
    * ``left`` / ``right``: only one runs per forward, the other gets no gradient.
    """

    def __init__(self, vocab: int = 11, dim: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)
        self.empty = nn.Parameter(torch.zeros(0))
        self.head = TiedHead(self.embed)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        zero_params.register_external_parameter(self.head, self.embed.weight)

    def forward(self, ids: torch.Tensor, go_left: bool = True) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.block(h)) + self.frozen(h) + self.empty.sum()
        h = self.left(h) if go_left else torch.relu(self.right(h))
        return self.head(h) + self.out(h)


class DeepMLP(nn.Module):
    """``depth`` equal layers (tanh between): the prefetch / live-bound workhorse."""

    def __init__(self, depth: int = 10, width: int = 17) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SwappableMLP(DeepMLP):
    """A DeepMLP whose layers 1 and 2 can run in swapped order (``swap=True``)."""

    def __init__(self) -> None:
        super().__init__(depth=4, width=9)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [0, 2, 1, 3] if self.swap else [0, 1, 2, 3]
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x


class Experts(nn.Module):
    """Routes each row to one expert: which experts run depends on the data."""

    def __init__(self, dim: int = 6, n_experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        gate = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue  # data-dependent: this expert does not run on this rank
            out = out.index_add(0, rows, expert(x[rows]) * gate[rows, e : e + 1])
        return out


class MoEModel(nn.Module):
    """Linear -> Experts (the leaf) -> Linear."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = Experts(dim)
        self.outp = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outp(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


# ---------------------------------------------------------------------------- sinks


class ReduceScatterSink:
    """The simplest sink: reduce-scatter each gradient as soon as it is ready.

    Records that every ``on_grad_ready`` saw the full gradient of a gathered parameter.
    """

    def __init__(self) -> None:
        self.ready: list[str] = []
        self.fills: dict[str, int] = {}  # how often each parameter's storage was filled, when ready
        self.ends = 0
        self.problems: list[str] = []

    def on_grad_ready(self, param: nn.Parameter) -> None:
        state = zero_params.state_of(param)
        self.fills[state.name] = state.unsharded.fills
        if state.status is not zero_params.ParamStatus.AVAILABLE:
            self.problems.append(f"{state.name} is {state.status.name} in on_grad_ready")
        if param.grad is None or param.grad.shape != state.shape:
            self.problems.append(f"{state.name} has no full gradient in on_grad_ready")
        self.ready.append(state.name)
        zero_params.reduce_scatter_grads([param])

    def on_backward_end(self) -> None:
        self.ends += 1


class DeferredSink:
    """Keeps each ready gradient and reduces every parameter at backward end, in a fixed order.

    For data-dependent models, where ranks get gradients for different parameters: missing
    gradients contribute zeros (``reduce_scatter_grads`` treats ``.grad is None`` as zeros),
    so all ranks issue the same collective.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.grads: dict[int, torch.Tensor] = {}
        self.ends = 0

    def on_grad_ready(self, param: nn.Parameter) -> None:
        self.grads[id(param)] = param.grad
        param.grad = None

    def on_backward_end(self) -> None:
        self.ends += 1
        full = [self.grads.pop(id(p), None) for p in self.params]
        with torch.no_grad():
            stacked = torch.cat(
                [
                    (g if g is not None else torch.zeros(zero_params.full_shape(p))).reshape(-1)
                    for g, p in zip(full, self.params)
                ]
            )
            tdist.all_reduce(stacked)
            stacked /= tdist.get_world_size()
        offset = 0
        for p in self.params:
            state = zero_params.state_of(p)
            acc = state.ensure_grad_partition()
            start, stop = state.shard_range
            acc[: stop - start] += stacked[offset + start : offset + stop]
            offset += state.numel


# ---------------------------------------------------------------------------- helpers


def build(model_cls: type[nn.Module], seed: int = 0, **kwargs) -> tuple[nn.Module, nn.Module]:
    """The same model twice from one seed: (to be partitioned, reference)."""
    torch.manual_seed(seed)
    model = model_cls(**kwargs)
    return model, copy.deepcopy(model)


def coordinate(model: nn.Module, config: CoordinatorConfig | None = None, sink=None) -> Coordinator:
    """Partition ``model`` over the world and install a coordinator on it."""
    zero_params.partition(model)
    coord = Coordinator(model, config or CoordinatorConfig(), sink)
    coord.install()
    return coord


def train_steps(
    model: nn.Module,
    ref: nn.Module,
    coord: Coordinator,
    batch: Callable[[int], torch.Tensor],
    steps: int = 3,
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.pow(2).mean(),
) -> tuple[list, float]:
    """``steps`` forward + backward passes on ``batch(step)``: each step's stats and the largest
    difference of the outputs from the reference model's."""
    stats, errors = [], []
    for step in range(steps):
        x = batch(step)
        out = model(x)
        loss(out).backward()
        stats.append(coord.last_step_stats)
        with torch.no_grad():
            errors.append((out - ref(x)).abs().max().item())
    return stats, max(errors)


def rank_input(seed: int, rank: int, shape: tuple[int, ...], high: int | None = None) -> torch.Tensor:
    """Deterministic per-rank data (integers below ``high`` when given)."""
    gen = torch.Generator().manual_seed(7919 * seed + rank)
    if high is not None:
        return torch.randint(0, high, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def reference_grads(ref: nn.Module, inputs: list, loss_fn, world: int) -> dict[str, torch.Tensor]:
    """Data-parallel average of the reference gradients over every rank's inputs (accumulated)."""
    for args in inputs:
        (loss_fn(ref(*args)) / world).backward()
    return {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}


def grad_partition_errors(model: nn.Module, expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max abs error of this rank's reduced gradient partition against the reference, per parameter."""
    errors = {}
    for name, p in model.named_parameters():
        state = zero_params.state_of(p)
        start, stop = state.shard_range
        got = state.grad_partition
        ref = expected.get(name)
        ref_part = torch.zeros(stop - start) if ref is None else ref.reshape(-1)[start:stop].to(torch.float32)
        got_part = torch.zeros(stop - start) if got is None else got[: stop - start]
        scale = max(ref_part.abs().max().item() if ref_part.numel() else 0.0, 1e-6)
        errors[name] = (got_part - ref_part).abs().max().item() / scale if ref_part.numel() else 0.0
    return errors


def gathered_params(model: nn.Module) -> list[str]:
    """Names of partitioned, non-persistent parameters that are not NOT_AVAILABLE."""
    out = []
    for name, p in model.named_parameters():
        state = zero_params.state_of(p)
        if not state.persistent and state.status is not zero_params.ParamStatus.NOT_AVAILABLE:
            out.append(name)
    return out


def hook_counts(module: nn.Module) -> int:
    """Forward hooks of every kind registered on ``module``."""
    return (
        len(module._forward_pre_hooks)
        + len(module._forward_hooks)
        + len(module._forward_hooks_always_called)
        + len(module._forward_pre_hooks_with_kwargs)
        + len(module._backward_hooks)
        + len(module._backward_pre_hooks)
    )


def grad_hook_count(param: nn.Parameter) -> int:
    """Post-accumulate-grad hooks on ``param``."""
    hooks = param._post_accumulate_grad_hooks
    return 0 if hooks is None else len(hooks)


class RecordHandler(logging.Handler):
    """Collects (level, message) of log records, to return them from a rank."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def capture_coord_logs() -> RecordHandler:
    """Attach a fresh INFO handler to the "zero.coord" logger (detach it with ``release_logs``)."""
    handler = RecordHandler()
    logger = logging.getLogger("zero.coord")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def release_logs(handler: RecordHandler) -> list[tuple[str, str]]:
    """Detach ``handler`` and return what it recorded."""
    logging.getLogger("zero.coord").removeHandler(handler)
    return handler.records
