"""The model zoo of zero's tests: small plain-torch models with odd shapes, one name each.

Unit tests, integration tests and their worker scripts build their models here, so one name
means one model everywhere. Builders that take ``seed`` seed torch's RNG themselves (``None``:
the caller's RNG state), so a single-process reference and every rank build bit-identical
weights. Every model returns its loss from ``forward``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "BareStack",
    "BranchyMLP",
    "ExternalUse",
    "MoE",
    "MoEMLP",
    "OddMLP",
    "PathNet",
    "ReluMLP",
    "Stack",
    "TanhMLP",
    "TiedLM",
]

VOCAB = 257


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)


class TanhMLP(nn.Module):
    """Linear layers of ``widths`` joined by tanh, named ``names`` (default ``a``, ``b``, ...).

    ``forward(x)`` is the mean square of the output; ``forward(x, y)`` the mean squared error.
    ``TanhMLP(11, 13, 3)`` is the two-layer model of most unit tests.
    """

    def __init__(self, *widths: int, seed: int | None = 0, names: tuple[str, ...] | None = None) -> None:
        if len(widths) < 2:
            raise ValueError(f"TanhMLP needs at least an input and an output width, got {widths}")
        names = names or tuple("abcdefghijklmnopqrstuvwxyz"[: len(widths) - 1])
        if len(names) != len(widths) - 1:
            raise ValueError(f"{len(widths) - 1} layers need as many names, got {names}")
        super().__init__()
        _seed(seed)
        for name, n_in, n_out in zip(names, widths[:-1], widths[1:], strict=True):
            self.add_module(name, nn.Linear(n_in, n_out))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        *hidden, last = self.children()
        for layer in hidden:
            x = torch.tanh(layer(x))
        out = last(x)
        return out.pow(2).mean() if y is None else ((out - y) ** 2).mean()


class PathNet(nn.Module):
    """``inp`` -> tanh -> ``mid`` -> ``out``; ``forward(x, extra=True)`` runs ``mid`` twice.

    The extra call is a path that only some ranks may take (the divergence tests).
    """

    def __init__(self, n_in: int = 7, hidden: int = 13, n_out: int = 3, seed: int | None = 0) -> None:
        super().__init__()
        _seed(seed)
        self.inp = nn.Linear(n_in, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.mid(torch.tanh(self.inp(x)))
        if extra:
            h = self.mid(h)
        return self.out(h).pow(2).mean()


class ReluMLP(nn.Module):
    """Linear layers of odd widths (a 1-wide one among them), ReLU between them; returns the output."""

    def __init__(self, dims: tuple[int, ...] = (7, 13, 1, 5, 11, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class OddMLP(nn.Module):
    """An MLP whose sizes are primes / odd numbers (uneven shards, padding on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 37)
        self.hidden = nn.Linear(37, 29)
        self.norm = nn.LayerNorm(29)
        self.out = nn.Linear(29, 7)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.norm(torch.relu(self.hidden(h)))
        return ((self.out(h) * self.scale - y) ** 2).mean()


class TiedLM(nn.Module):
    """A tiny language model whose output projection is the input embedding (one Parameter)."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, 24)
        self.block = nn.Sequential(nn.Linear(24, 41), nn.GELU(), nn.Linear(41, 24))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids[:, :-1])
        h = self.norm(h + self.block(h))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


class ExternalUse(nn.Module):
    """The root's forward reads its embedding's weight directly (an external parameter use).

    Under ZeRO-3 this needs ``register_external_parameter(model, model.embed.weight)``.
    """

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, 24)
        self.norm = nn.LayerNorm(24)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids[:, :-1]))
        logits = nn.functional.linear(h, self.embed.weight)
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


class BranchyMLP(nn.Module):
    """Takes an extra block only on the steps whose data say so (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 31)
        self.extra = nn.Sequential(nn.Linear(31, 31), nn.Tanh(), nn.Linear(31, 31))
        self.out = nn.Linear(31, 7)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_extra: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if bool(use_extra):
            h = h + self.extra(h)
        return ((self.out(h) - y) ** 2).mean()


class MoE(nn.Module):
    """Two experts; each rank routes its whole micro-batch to one, chosen by its own data.

    Ranks take different experts on some steps: the block must be a zero_coord leaf module.
    """

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(31, 31) for _ in range(2))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.experts[int(route.sum() > 0)](h)


class MoEMLP(nn.Module):
    """An MLP around a :class:`MoE` block routed by the sign of the input's first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 31)
        self.moe = MoE()
        self.out = nn.Linear(31, 7)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + self.moe(h, x[:, 0])
        return ((self.out(h) - y) ** 2).mean()


class Stack(nn.Module):
    """``depth`` equal linear layers (for the live-parameter bound)."""

    def __init__(self, width: int = 32, depth: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


class BareStack(nn.Module):
    """``depth`` bias-free ``Linear(29, 29)`` layers (uneven shards), optionally checkpointed.

    ``checkpointing``: ``"reentrant"`` / ``"non_reentrant"`` runs each layer after the first
    under ``torch.utils.checkpoint`` with that flavour.
    """

    def __init__(self, depth: int = 6, checkpointing: str = "none") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(29, 29, bias=False) for _ in range(depth))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.checkpointing == "none" or i == 0:  # a reentrant checkpoint needs a grad-requiring input
                x = torch.tanh(layer(x))
            else:
                x = torch.tanh(checkpoint(layer, x, use_reentrant=self.checkpointing == "reentrant"))
        return ((x - y) ** 2).mean()
