"""One rank's peak resident memory training a GPT-2 under stage 3, three ways: ``python -m
torch.distributed.run --nproc_per_node 2 trainer_rss_worker.py OUT_DIR --mode direct|hf|lightning``.

* ``direct``: the model built under ``zero_full.Init``, ``zero_full.initialize`` and a plain loop;
* ``hf``: the same model built under ``zero_full.Init`` and trained by ``ZeroTrainer``;
* ``lightning``: ``Trainer(strategy="zero_stage_3")`` (the registered name, no config), the model
  built in ``configure_model``.

Every mode imports the same libraries, joins the process group and first trains a small model
the same way (the mode's lazy imports, thread pools and caches) before the baseline is read, so
the figures are what the 21M-parameter model adds; run with ``MALLOC_MMAP_THRESHOLD_=1048576`` so
freed tensors leave the resident set. Each rank writes ``OUT_DIR/rank<r>.json``: the peak
resident bytes above the baseline from building the model to the end of training (``peak``),
the whole-process peak (``hwm``), the parameter count and how many parameters are split.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainer_models import TokenDataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zero_full
import zero_full.lightning  # noqa: F401  registers "zero_stage_3"
import zero_params
from zero_full.hf_trainer import ZeroTrainer
from zero_testing.rss import peak_bytes, reset_peak, resident_bytes

VOCAB, SEQ, BATCH, STEPS, LR = 16000, 32, 2, 4, 1e-4
CONFIG = {  # every other setting at its default (persistence threshold 100k elements)
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
}


WIDTH = {True: 32, False: 512}


def build(small: bool) -> GPT2LMHeadModel:
    """A GPT-2 of about 21M parameters (84 MB in fp32), or a small one of the same shape for the
    warm-up; the weights a pure function of the seed."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH[small], n_layer=4, n_head=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * 2 * STEPS, SEQ), generator=torch.Generator().manual_seed(7))


def run_direct(out: Path, small: bool) -> torch.nn.Module:
    with zero_full.Init(config=CONFIG):
        model = build(small)
    engine = zero_full.initialize(model, CONFIG, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    ids = tokens()[dist.get_rank() :: dist.get_world_size()]
    for step in range(STEPS):
        batch = ids[step * BATCH : (step + 1) * BATCH]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    return model


def run_hf(out: Path, small: bool) -> torch.nn.Module:
    args = TrainingArguments(
        output_dir=str(out / f"hf{int(small)}"), per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=LR, max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True, logging_steps=1,
        dataloader_drop_last=True, disable_tqdm=True, optim="adamw_torch",
    )  # fmt: skip
    with zero_full.Init(config=CONFIG):
        model = build(small)
    ZeroTrainer(model=model, args=args, train_dataset=TokenDataset(tokens()), zero_config=CONFIG).train()
    return model


class _LitGPT2(pl.LightningModule):
    def __init__(self, small: bool) -> None:
        super().__init__()
        self.small = small
        self.net: GPT2LMHeadModel | None = None

    def configure_model(self) -> None:
        if self.net is None:  # inside zero_full.Init
            self.net = build(self.small)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def run_lightning(out: Path, small: bool) -> torch.nn.Module:
    world = dist.get_world_size()
    data = TensorDataset(tokens())
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, world, dist.get_rank()))
    trainer = pl.Trainer(
        strategy="zero_stage_3", accelerator="cpu", devices=world, max_steps=STEPS, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    module = _LitGPT2(small)
    trainer.fit(module, train_dataloaders=loader)
    return module.net


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", required=True, choices=["direct", "hf", "lightning"])
    args = ap.parse_args()
    dist.init_process_group("gloo")
    run = {"direct": run_direct, "hf": run_hf, "lightning": run_lightning}[args.mode]
    run(args.out, small=True)  # warm-up: the mode's lazy imports, thread pools and caches
    gc.collect()
    base = resident_bytes()
    reset_peak()
    model = run(args.out, small=False)
    peak = peak_bytes()
    params = list(model.parameters())
    split = [zero_params.is_partitioned(p) and not zero_params.state_of(p).persistent for p in params]
    result = {
        "peak": peak - base,
        "hwm": peak,
        "base": base,
        "psi": sum(zero_params.state_of(p).numel for p in params),
        "split": [sum(split), len(split)],
        "partitioned": all(zero_params.is_partitioned(p) for p in params),
    }
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
