"""The workloads the benchmarks train (side by side, memory; generate, mics, cluster: a GPT-2 by width).

A :class:`Workload` is frozen: the model (a ``transformers`` GPT-2 built from a config with
random weights from a seed, by ``zero_full.cli.train.workloads.GPT2Workload``, a plain MLP, or a stack
of bias-free square Linear layers where parameters dominate memory), the data (each step's
global batch is a pure function of the seed and the step; rank ``r`` of ``W`` takes slice
``r``, the single-process reference takes all of it) and the fp32 AdamW hyperparameters (:data:`ADAMW`, passed
explicitly to every implementation: DeepSpeed's and torch's defaults differ).

The loss is the mean over this rank's slice; every slice has the same number of tokens, so
the mean of the ranks' losses is the loss of the whole global batch, and averaging the
ranks' gradients (what every data-parallel implementation does) gives its gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser

if TYPE_CHECKING:
    from zero_full.cli.train.workloads import GPT2Workload

__all__ = [
    "ADAMW",
    "GPT2Loss",
    "Workload",
    "adamw",
    "block_modules",
    "build_model",
    "count_params",
    "enable_checkpointing",
    "global_batch",
    "gpt2_of_width",
    "loss_of",
    "num_params",
    "rank_batches",
    "QUICK_SHAPE",
    "shape_defaults",
    "workload_of",
    "workload_parser",
]

# Every implementation's AdamW, all hyperparameters explicit (torch's defaults, lr raised).
ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Model, data and batch of the benchmark.

    Attributes:
        kind: ``"gpt2"`` (a ``transformers`` GPT-2 LM head model, embeddings tied), ``"mlp"`` or
            ``"linear"``.
        layers, hidden, heads, vocab, seq: GPT-2 shape (``mlp``: ``layers`` Linear+GELU blocks
            of width ``hidden`` between an input of ``vocab // 32`` features and ``seq`` outputs;
            ``linear``: ``layers`` bias-free ``Linear(hidden, hidden)`` + ReLU blocks, ``hidden``
            inputs and outputs, ``heads`` / ``vocab`` / ``seq`` unused).
        micro_batch: Sequences (rows) per rank per step.
        seed: Seed of the weights and the data.
    """

    kind: str = "gpt2"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 8192
    seq: int = 128
    micro_batch: int = 4
    seed: int = 0

    def gpt2(self) -> GPT2Workload:
        """The GPT-2 of ``kind == "gpt2"`` (zero_full's builder: config, seeded model, batches).

        Imported here, not at the top: a memory benchmark of DDP imports ``zero_full`` only as
        part of its measured baseline (``benchmarks.kit.step_memory._import_libraries``).
        """
        from zero_full.cli.train.workloads import GPT2Workload

        return GPT2Workload(self.layers, self.hidden, self.heads, self.vocab, self.seq, self.seed)

    def describe(self) -> str:
        """One line naming the model and batch."""
        if self.kind == "gpt2":
            shape = (
                f"GPT-2 (transformers) {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"vocab {self.vocab}, sequence {self.seq}"
            )
        elif self.kind == "linear":
            shape = f"{self.layers} x Linear({self.hidden}, {self.hidden}, bias=False) + ReLU"
        else:
            shape = f"MLP {self.layers} x Linear({self.hidden}) + GELU, in {self.vocab // 32}, out {self.seq}"
        return f"{shape}, micro-batch {self.micro_batch} per rank"


SHAPE_FIELDS = ("layers", "hidden", "heads", "vocab", "seq", "micro_batch")
QUICK_SHAPE = {"layers": 2, "hidden": 64, "vocab": 512, "seq": 32}
"""The shape a benchmark's ``--quick`` gives the workload: a smoke run."""


def shape_defaults() -> dict[str, int]:
    """A script's command-line defaults for the workload's shape: :class:`Workload`'s own."""
    default = Workload()
    return {name: getattr(default, name) for name in SHAPE_FIELDS}


def workload_parser(
    name: str, doc: str, *, quick: Mapping[str, Any] | None = None, **options: Any
) -> BenchmarkParser:
    """:func:`benchmarks.kit.cli.benchmark_parser` with the workload's shape options first (``--layers``,
    ..., ``--micro-batch``, defaults :func:`shape_defaults`, ``--quick``: :data:`QUICK_SHAPE`, then
    ``quick``); read them back with :func:`workload_of`."""
    return benchmark_parser(name, doc, quick={**QUICK_SHAPE, **(quick or {})}, **shape_defaults(), **options)


def workload_of(args: Any, kind: str = "gpt2") -> Workload:
    """The ``kind`` workload of the shape options ``args`` holds (``--layers``, ..., ``--micro-batch``)."""
    return Workload(kind, **{name: getattr(args, name) for name in SHAPE_FIELDS})


class MLP(nn.Module):
    """``layers`` blocks of Linear + GELU with a linear head; the loss is the mean squared error."""

    def __init__(self, inputs: int, hidden: int, layers: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, outputs)
        self.checkpointed = False  # recompute each block in backward (torch.utils.checkpoint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_run_blocks(self.blocks, self.inp(x), self.checkpointed))


class LinearStack(nn.Module):
    """``layers`` bias-free ``Linear(hidden, hidden)`` + ReLU blocks: parameters dominate memory."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden, bias=False), nn.ReLU()) for _ in range(layers)
        )
        self.checkpointed = False  # recompute each block in backward (torch.utils.checkpoint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_blocks(self.blocks, x, self.checkpointed)


def _run_blocks(blocks: nn.ModuleList, h: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
    return h


def build_model(w: Workload) -> nn.Module:
    """The model with weights seeded by ``w.seed`` (identical in every process); no dropout."""
    torch.manual_seed(w.seed)
    if w.kind == "mlp":
        return MLP(w.vocab // 32, w.hidden, w.layers, w.seq)
    if w.kind == "linear":
        return LinearStack(w.hidden, w.layers)
    if w.kind != "gpt2":
        raise ValueError(f"unknown workload kind {w.kind!r}: use 'gpt2', 'mlp' or 'linear'")
    return w.gpt2().build_model()


def gpt2_of_width(
    layers: int, width: int, vocab: int, seq: int, positions: int | None = None
) -> GPT2Workload:
    """The GPT-2 of a benchmark sized by ``--width``: one head per 64 of width (at least one), seed 0."""
    from zero_full.cli.train.workloads import GPT2Workload

    return GPT2Workload(layers, width, max(1, width // 64), vocab, seq, seed=0, positions=positions)


class GPT2Loss(nn.Module):
    """A ``transformers`` LM whose forward returns the LM loss of ``ids`` (the labels are the inputs)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (what FSDP2 wraps with ``fully_shard`` one by one)."""
    if isinstance(model, MLP | LinearStack):
        return list(model.blocks)
    return list(model.transformer.h)


def enable_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing of every block (non-reentrant ``torch.utils.checkpoint``).

    GPT-2 through ``transformers``' own checkpointing (``enable_hf_checkpointing``); the MLP and the
    Linear stack wrap each block's call in ``checkpoint``.
    """
    if isinstance(model, MLP | LinearStack):
        model.checkpointed = True
    else:
        from zero_full.cli.train.workloads import enable_hf_checkpointing

        enable_hf_checkpointing(model, use_reentrant=False)


def num_params(model: nn.Module) -> int:
    """P: parameters of the model, each shared (tied) tensor once."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))


def global_batch(w: Workload, step: int, world: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch: ``micro_batch * world`` rows, a pure function of seed and step."""
    rows = w.micro_batch * world
    gen = torch.Generator().manual_seed(w.seed * 1_000_003 + step)
    if w.kind == "mlp":
        x = torch.randn(rows, w.vocab // 32, generator=gen)
        return {"x": x, "y": torch.randn(rows, w.seq, generator=gen)}
    if w.kind == "linear":
        x = torch.randn(rows, w.hidden, generator=gen)
        return {"x": x, "y": torch.randn(rows, w.hidden, generator=gen)}
    return {"ids": w.gpt2().uniform_batch(step, rows)}


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a global batch (contiguous, equal slices)."""
    return {k: v.chunk(world)[rank].contiguous() for k, v in batch.items()}


def rank_batches(w: Workload, rank: int, world: int, steps: int, rows: int | None = None) -> list[dict]:
    """Rank ``rank``'s slices of the first ``steps`` global batches (of ``rows`` ranks' rows,
    default ``world``; ``world`` 1 with ``rows`` N: the whole batch of N ranks, for a reference)."""
    return [rank_slice(global_batch(w, s, rows or world), rank, world) for s in range(steps)]


def count_params(w: Workload) -> int:
    """P of the workload's model (built once, on the CPU)."""
    return num_params(build_model(w))


def loss_of(model: Any, w: Workload, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean loss of ``batch`` under ``model`` (any callable wrapping the model: DDP, engines)."""
    if w.kind in ("mlp", "linear"):
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])
    ids = batch["ids"]
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def adamw(params: Any) -> torch.optim.AdamW:
    """torch's fp32 AdamW with :data:`ADAMW` (``foreach`` off: one kernel path everywhere)."""
    return torch.optim.AdamW(params, **ADAMW, foreach=False)
