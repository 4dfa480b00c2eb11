"""Models, data and training loops shared by the integration tests.

Every builder seeds torch's RNG itself, so the single-process reference and every rank
build bit-identical models. Each step's global batch is a pure function of the step and
micro-step index; rank ``r`` trains on slice ``r`` of it, the reference on all of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_coord
import zero_full
import zero_params
from zero_full.cli.train.workloads import GPT2Workload, enable_hf_checkpointing
from zero_testing.models import BareStack, BranchyMLP, ExternalUse, MoE, MoEMLP, OddMLP, Stack, TiedLM

SEQ = 16
VOCAB = 257


# --------------------------------------------------------------------------- models


def gpt2() -> nn.Module:
    """A 2-layer GPT-2 from ``transformers`` (random init from the caller's seed, no dropout, tied head)."""
    return GPT2Workload(
        layers=2, hidden=64, heads=4, vocab=VOCAB, seq=SEQ, seed=None, positions=32
    ).build_model()


class GPT2Loss(nn.Module):
    """Wraps the HF model so that ``model(ids)`` returns the LM loss.

    ``checkpointing``: ``"reentrant"`` / ``"non_reentrant"`` turns on HF's activation
    checkpointing of every block with that ``torch.utils.checkpoint`` flavour.
    """

    def __init__(self, build_lm: Callable[[], nn.Module] = gpt2, checkpointing: str = "none") -> None:
        super().__init__()
        self.lm = build_lm()
        if checkpointing != "none":
            enable_hf_checkpointing(self.lm, use_reentrant=checkpointing == "reentrant")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def tied_llama() -> nn.Module:
    """A 2-layer LLaMA from ``transformers`` whose lm_head is the input embedding (one Parameter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=53,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------- data


def _dense(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(n, 13, generator=gen), torch.randn(n, 7, generator=gen)


def _tokens(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (n, SEQ), generator=gen),)


def _stack(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(n, 32, generator=gen), torch.randn(n, 32, generator=gen).tanh()


def _bare(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(n, 29, generator=gen), torch.randn(n, 29, generator=gen).tanh()


@dataclasses.dataclass(frozen=True)
class Case:
    """A model builder and the batches it trains on."""

    build: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]
    per_rank: bool = False  # the reference runs each rank's slice separately (rank-dependent routing)


CASES: dict[str, Case] = {
    "mlp": Case(OddMLP, _dense),
    "gpt2": Case(GPT2Loss, _tokens),
    "tied": Case(TiedLM, _tokens),
    "branchy": Case(BranchyMLP, _dense),
    "moe": Case(MoEMLP, _dense, per_rank=True),
    "external": Case(ExternalUse, _tokens),
    "stack": Case(Stack, _stack),
}
for _ckpt in ("none", "reentrant", "non_reentrant"):
    _suffix = "" if _ckpt == "none" else f"_{_ckpt}"
    CASES[f"bare{_suffix}"] = Case(functools.partial(BareStack, checkpointing=_ckpt), _bare)
    CASES[f"gpt2{_suffix}"] = Case(functools.partial(GPT2Loss, checkpointing=_ckpt), _tokens)
    CASES[f"llama{_suffix}"] = Case(functools.partial(GPT2Loss, tied_llama, _ckpt), _tokens)


def build(name: str) -> nn.Module:
    """Build model ``name`` from a fixed seed."""
    torch.manual_seed(1234)
    return CASES[name].build()


def global_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, ...]:
    """The whole batch of one micro-step index of ``step`` (same on every process)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    batch = CASES[name].data(gen, size)
    if name == "branchy":
        batch = (*batch, torch.tensor(step % 3 == 1))
    return batch


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s equal share of ``batch`` (0-d step-wide flags are passed whole)."""
    n = batch[0].shape[0] // world
    return tuple(t[rank * n : (rank + 1) * n] if t.dim() > 0 else t for t in batch)


# --------------------------------------------------------------------------- training


def make_optimizer(kind: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``"adamw"`` or ``"sgd"`` (momentum), as an optimizer callable."""
    if kind == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01)
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    raise ValueError(kind)


def reference_run(
    name: str, kind: str, steps: int, batch: int, accumulation: int = 1, world: int = 1
) -> dict[str, Any]:
    """Single-process training on the whole global batch: per-step losses and final parameters.

    Gradients start at zero and are zeroed in place, so a parameter without a gradient in
    a step is stepped with a zero gradient, as the partitioned optimizer does. A model that
    routes per rank (``Case.per_rank``) averages the losses of the ``world`` rank slices.
    """
    model = build(name)
    opt = make_optimizer(kind)(list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    losses = []
    for step in range(steps):
        full = [global_batch(name, step * accumulation + m, batch) for m in range(accumulation)]
        if CASES[name].per_rank:
            parts = [model(*rank_slice(b, r, world)) for b in full for r in range(world)]
            loss = sum(parts) / len(parts)
        else:
            loss = model(*(torch.cat(t) if t[0].dim() > 0 else t[0] for t in zip(*full)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def assert_ranks_agree_and_match(
    results: list[dict[str, Any]], ref: dict[str, Any], kind: str
) -> dict[str, Any]:
    """The DESIGN.md yardstick on per-rank results of a training run; returns rank 0's.

    Every rank must report rank 0's losses and hold rank 0's parameters bit for bit; rank 0's
    losses must equal the single-process reference within 1e-5 relative, and with SGD (``kind``
    ``"sgd"``) its final parameters too (Adam turns float noise into updates: losses only).
    """
    from zero_testing import assert_losses_close, assert_state_close

    first = results[0]
    for r, res in enumerate(results[1:], start=1):
        assert res["losses"] == first["losses"], f"rank {r} reports other losses than rank 0"
        for n, p in res["params"].items():
            assert torch.equal(p, first["params"][n]), f"rank {r} holds another {n} than rank 0"
    assert_losses_close(first["losses"], ref["losses"], rel=1e-5)
    if kind == "sgd":
        assert_state_close(first["params"], ref["params"], rel=1e-5)
    return first


def mean_over_ranks(value: float) -> float:
    """The average of a float over all ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def zero_config(**zero: Any) -> dict[str, Any]:
    """A stage-3 DeepSpeed-style config; ``zero`` adds ``zero_optimization`` keys.

    ``gradient_accumulation_steps`` given here goes to the top level.
    """
    accumulation = zero.pop("gradient_accumulation_steps", 1)
    return {
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def train_steps(
    engine: Any,
    name: str,
    steps: int,
    batch: int,
    *,
    start: int = 0,
    dtype: torch.dtype | None = None,
    after_micro: Callable[[], None] | None = None,
) -> list[float]:
    """``steps`` optimizer steps of model ``name`` from step ``start`` on this rank's slices of the
    global batches (inputs cast to ``dtype`` if given); the losses averaged over ranks and micro-steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    accumulation = engine.gradient_accumulation_steps
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for micro in range(accumulation):
            inputs = rank_slice(global_batch(name, step * accumulation + micro, batch), rank, world)
            if dtype is not None:
                inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
            loss = engine(*inputs)
            engine.backward(loss)
            engine.step()
            total += loss.float().item()
            if after_micro is not None:
                after_micro()
        losses.append(mean_over_ranks(total / accumulation))
    return losses


def save_then_continue(engine: Any, name: str, root: str, batch: int) -> dict[str, Any]:
    """Three steps, a checkpoint at ``root``, the consolidated weights, then three more steps' losses."""
    train_steps(engine, name, 3, batch)
    engine.save_checkpoint(root)
    weights = engine.consolidated_state_dict()
    losses = train_steps(engine, name, 3, batch, start=3)
    engine.close()
    return {"losses": losses, "weights": weights}


def zero_run(
    rank: Any, name: str, kind: str, steps: int, batch: int, config: dict[str, Any]
) -> dict[str, Any]:
    """Train model ``name`` with the zero engine on this rank's slices of the global batches.

    Returns:
        Per-step losses (averaged over ranks and micro-steps), the final full parameters
        (gathered) and the names of the persistent parameters.
    """
    model = build(name)
    if name == "moe":
        zero_coord.set_leaf_modules(model, [MoE])  # ranks route differently inside it
    if name == "external":
        zero_full.register_external_parameter(model, model.embed.weight)
    engine = zero_full.initialize(model, config, make_optimizer(kind))
    losses = train_steps(engine, name, steps, batch)
    persistent = sorted(n for n, p in model.named_parameters() if zero_params.state_of(p).persistent)
    with zero_params.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"losses": losses, "params": params, "persistent": persistent}
