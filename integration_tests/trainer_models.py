"""The tiny language model and data of the Lightning and Hugging Face Trainer integration tests.

A GPT-2 and a LLaMA built from configs (no download), dropout off, a fixed token dataset: the
reference (one process, the whole global batch) and each zero rank see the same model
and the same global batches. ``worker_parser``: the options both trainer workers take.
"""

from __future__ import annotations

import argparse

import torch

VOCAB = 97
SEQ = 16
SAMPLES = 64


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=24, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def build_gpt2():
    """The model, its weights a pure function of the seed."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1234)
    return GPT2LMHeadModel(gpt2_config())


def build_gpt2_wide():
    """A wider GPT-2 (``n_embd`` 192): its attention and MLP matrices (110k-147k elements) are above
    stage 3's default persistence threshold of 100k, the smaller tensors below it."""
    from transformers import GPT2LMHeadModel

    config = gpt2_config()
    config.n_embd = 192
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def build_llama():
    """The LLaMA variant (grouped-query attention, untied head), its weights a pure function of the seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    return LlamaForCausalLM(llama_config())


BUILDERS = {"gpt2": build_gpt2, "gpt2_wide": build_gpt2_wide, "llama": build_llama}


def worker_parser() -> argparse.ArgumentParser:
    """The options of both trainer workers: the JSON file rank 0 writes, the model, the batch per
    device, gradient accumulation and a checkpoint to resume from."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="gpt2", choices=sorted(BUILDERS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--resume", default=None)
    return ap


def token_data(samples: int = SAMPLES) -> torch.Tensor:
    """``samples`` sequences of ``SEQ`` token ids (a fixed generator: the same on every rank)."""
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(7))


class TokenDataset(torch.utils.data.Dataset):
    """Token id sequences as the Hugging Face ``Trainer`` takes them: each its own labels (a causal LM)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
