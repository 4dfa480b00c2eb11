"""DeepSpeedExamples' DeepSpeed-Chat step-1 fine-tuning (``main.py --zero_stage 3``) call sequence.

A tiny GPT-2 causal LM on synthetic token sequences, with the script's DeepSpeed calls in
its order: ``add_config_arguments``, ``get_accelerator().set_device`` /
``device_name()``, ``init_distributed()``, the model built under ``zero.Init`` from the
stage-3 config and its weights loaded module by module under
``zero.GatheredParameters(..., modifier_rank=0)`` (what ``from_pretrained`` does under
ZeRO-3), grouped parameters (weight decay / none) for a client AdamW and a client cosine
LR schedule with warm-up, ``initialize(model=, optimizer=, args=, config=, lr_scheduler=,
dist_init_required=True)``, ``train()`` / forward / ``backward`` / ``step`` with gradient
accumulation, an evaluation under ``eval()`` and ``torch.no_grad()`` averaged with an
all-reduce, and the final weights gathered parameter by parameter under
``GatheredParameters([p])`` on rank 0 (``save_zero_three_model``). Added for the test:
``save_checkpoint`` after the first epoch and a second engine that resumes from it.

Usage: ``torchrun --nproc-per-node 2 sft_zero3_ds.py --out DIR`` (``DS_IMPL`` picks the module).
"""

from __future__ import annotations

import argparse
import math

import torch
from common import deepspeed_module, write_result
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

deepspeed = deepspeed_module()
SEQ, VOCAB = 12, 96


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--num_warmup_steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_train_ds_config(args: argparse.Namespace, world: int) -> dict:
    return {
        "train_batch_size": args.per_device_train_batch_size * world * args.gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none"},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
    }


def sequences(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]


def pretrained_state() -> dict[str, torch.Tensor]:
    """The 'pretrained' weights every run loads (a seeded plain model's)."""
    torch.manual_seed(1234)
    return GPT2LMHeadModel(model_config()).state_dict()


def model_config() -> GPT2Config:
    no_dropout = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0)
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, **no_dropout)


def create_hf_model(ds_config: dict) -> GPT2LMHeadModel:
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT2LMHeadModel(model_config())
    state = pretrained_state() if torch.distributed.get_rank() == 0 else None
    for prefix, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with torch.no_grad():
                    for name, p in module.named_parameters(recurse=False):
                        p.copy_(state[f"{prefix}.{name}" if prefix else name])
    return model


def get_optimizer_grouped_parameters(model, weight_decay: float) -> list[dict]:
    no_decay = ["bias", "ln_"]
    return [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]


def get_all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def evaluation(model, eval_dataloader, device) -> float:
    model.eval()
    losses, batches = torch.zeros(()), 0
    for batch in eval_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            losses += model(**batch).loss.float()
        batches += 1
    return get_all_reduce_mean(losses / batches).item()


def save_zero_three_model(model_ema, global_rank: int) -> dict[str, list[float]]:
    output_state_dict = {}
    for k, v in model_ema.module.named_parameters():
        with deepspeed.zero.GatheredParameters([v], enabled=True):
            v_p = v.data.cpu()
        if global_rank == 0:
            output_state_dict[k] = v_p.reshape(-1)[:4].tolist()
    return output_state_dict


def build(args, ds_config, train_dataloader):
    model = create_hf_model(ds_config)
    optimizer = torch.optim.AdamW(
        get_optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95)
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )
    return model, lr_scheduler


def train_epoch(model, lr_scheduler, train_dataloader, device, epoch: int):
    train_dataloader.sampler.set_epoch(epoch)
    model.train()
    losses, lrs = [], []
    for batch in train_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch, use_cache=False)
        loss = outputs.loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        lrs.append(lr_scheduler.get_last_lr()[0])
    return losses, lrs


def main() -> None:
    args = parse_args()
    local_rank = max(args.local_rank, 0)
    deepspeed.get_accelerator().set_device(local_rank)
    device = torch.device(deepspeed.get_accelerator().device_name(local_rank))
    deepspeed.init_distributed()
    global_rank = torch.distributed.get_rank()
    ds_config = get_train_ds_config(args, torch.distributed.get_world_size())
    torch.distributed.barrier()
    train_dataset, eval_dataset = sequences(80, 0), sequences(16, 1)
    train_dataloader = DataLoader(
        train_dataset, sampler=DistributedSampler(train_dataset), batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        eval_dataset, sampler=DistributedSampler(eval_dataset), batch_size=args.per_device_train_batch_size
    )
    model, lr_scheduler = build(args, ds_config, train_dataloader)
    losses, lrs = train_epoch(model, lr_scheduler, train_dataloader, device, 0)
    model.save_checkpoint(f"{args.out}/sft-{deepspeed.__name__}", client_state={"epoch": 1})
    more, more_lrs = train_epoch(model, lr_scheduler, train_dataloader, device, 1)
    eval_loss = evaluation(model, eval_dataloader, device)
    weights = save_zero_three_model(model, global_rank)
    resumed_model, resumed_scheduler = build(args, ds_config, train_dataloader)
    _, client_state = resumed_model.load_checkpoint(f"{args.out}/sft-{deepspeed.__name__}")
    resumed, resumed_lrs = train_epoch(resumed_model, resumed_scheduler, train_dataloader, device, 1)
    write_result(
        args.out,
        global_rank,
        {
            "losses": losses + more,
            "lrs": lrs + more_lrs,
            "eval_loss": eval_loss,
            "weights": weights,
            "resumed": resumed,
            "resumed_lrs": resumed_lrs,
            "client_state": client_state,
            "global_steps": model.global_steps,
            "grad_norm": model.get_global_grad_norm(),
        },
    )


if __name__ == "__main__":
    main()
