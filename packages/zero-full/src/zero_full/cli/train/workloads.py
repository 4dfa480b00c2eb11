"""The GPT-2 workload: config, model and synthetic batches, the same in every process."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from torch import nn

__all__ = ["GPT2Workload", "enable_hf_checkpointing", "require_transformers"]

_MARKOV_STAY = 0.8  # probability that the next token follows the chain (the rest is uniform noise)


def require_transformers() -> None:
    """Raise ``ModuleNotFoundError`` naming the extra when ``transformers`` is not installed."""
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(
            "the demo model is built with the 'transformers' package, which is not installed: "
            "pip install zero-full[demo]"
        )


def enable_hf_checkpointing(model: nn.Module, *, use_reentrant: bool) -> None:
    """Turn on activation checkpointing of every block of a ``transformers`` model.

    ``use_reentrant`` picks the ``torch.utils.checkpoint`` flavour. Through
    ``activation_checkpointing_enable`` where ``transformers`` has it (5.x: the older
    ``gradient_checkpointing_enable`` is a deprecated alias that warns), else through
    ``gradient_checkpointing_enable`` (4.x).
    """
    kwargs = {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        return
    legacy = getattr(model, "gradient_checkpointing_enable", None)
    if legacy is None:
        raise TypeError(
            f"{type(model).__name__} has no activation checkpointing of its own: "
            "expected a transformers PreTrainedModel"
        )
    legacy(gradient_checkpointing_kwargs=kwargs)


@dataclasses.dataclass(frozen=True)
class GPT2Workload:
    """A GPT-2 shape, its seed and its data."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    vocab: int = 1024
    seq: int = 64
    seed: int | None = 0
    positions: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT2Workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 2:
            raise ValueError(f"GPT2Workload.vocab must be >= 2, got {self.vocab}")
        if self.hidden % self.heads:
            raise ValueError(f"GPT2Workload.hidden {self.hidden} must be a multiple of heads {self.heads}")

    def config(self) -> Any:
        """The ``transformers.GPT2Config``: no dropout, token 0 is BOS and EOS."""
        require_transformers()
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=self.layers,
            n_embd=self.hidden,
            n_head=self.heads,
            vocab_size=self.vocab,
            n_positions=self.positions or self.seq,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )

    def build_model(self) -> nn.Module:
        """A ``GPT2LMHeadModel`` with random weights from ``seed`` (identical in every process)."""
        cfg = self.config()
        from transformers import GPT2LMHeadModel

        if self.seed is not None:
            torch.manual_seed(self.seed)
        return GPT2LMHeadModel(cfg)

    def _data_seed(self) -> int:
        return self.seed or 0

    def markov_batch(self, index: int, rows: int) -> torch.Tensor:
        """Batch ``index``: ``rows`` sequences of ``seq`` tokens from a Markov chain (int64).

        The chain (a fixed random permutation of the vocabulary, seeded by ``seed``) gives each
        token's successor; with probability ``1 - 0.8`` a token is uniform noise instead. The
        loss can fall from ``ln(vocab)`` towards the chain's entropy. Same on every process.
        """
        seed = self._data_seed()
        successor = torch.randperm(self.vocab, generator=torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * index + 1)
        noise = torch.randint(0, self.vocab, (rows, self.seq), generator=gen)
        follow = torch.rand(rows, self.seq, generator=gen) < _MARKOV_STAY
        tokens = noise.clone()
        for t in range(1, self.seq):
            tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], noise[:, t])
        return tokens

    def uniform_batch(self, index: int, rows: int) -> torch.Tensor:
        """Batch ``index``: ``rows`` sequences of ``seq`` uniform random tokens (int64)."""
        gen = torch.Generator().manual_seed(self._data_seed() * 1_000_003 + index)
        return torch.randint(0, self.vocab, (rows, self.seq), generator=gen)
