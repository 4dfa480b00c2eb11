"""DeepSpeedExamples' training/cifar call sequence, on synthetic CIFAR-shaped data.

The same DeepSpeed calls in the same order as ``cifar10_deepspeed.py``: ``init_distributed``,
``add_config_arguments``, ``initialize(args=, model=, model_parameters=, training_data=)``
with the config from ``--deepspeed_config`` (``cifar_ds_config.json``: the example's
``ds_config.json`` with WarmupLR over 8 steps, ``steps_per_print`` 5, fp32 (``bf16`` off, so the
comparison is exact), ``torch_adam`` (DeepSpeed compiles no Adam kernel), and without the keys
that change nothing but this zero version's config does not accept yet: ``prescale_gradients``,
``cpu_offload``, the loss-scale keys in ``bf16``, ``fp16_master_weights_and_grads``),
``get_accelerator().device_name(engine.local_rank)``, ``bfloat16_enabled()``, then
forward / ``backward`` / ``step`` over the returned loader. Added for the test: a
``save_checkpoint`` half way, and a second engine that ``load_checkpoint``s it and trains
the second half again.

Usage: ``torchrun --nproc-per-node 2 cifar_ds.py --deepspeed_config ds_config.json --out DIR``
(``DS_IMPL=deepspeed`` or ``zero`` picks the ``deepspeed`` module).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import deepspeed_module, images, write_result
from torch import nn

deepspeed = deepspeed_module()


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=192)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def build(args: argparse.Namespace, trainset: torch.utils.data.Dataset) -> tuple:
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    return model_engine, trainloader


def train(model_engine, trainloader, epochs: int, skip: int = 0) -> tuple[list[float], list[float]]:
    local_device = deepspeed.get_accelerator().device_name(model_engine.local_rank)
    bf16 = model_engine.bfloat16_enabled()
    criterion = nn.CrossEntropyLoss()
    losses, lrs = [], []
    seen = 0
    for _epoch in range(epochs):
        for data in trainloader:
            seen += 1
            if seen <= skip:
                continue
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if bf16:
                inputs = inputs.to(torch.bfloat16)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            lrs.append(model_engine.get_lr()[0])
    return losses, lrs


def main() -> None:
    deepspeed.init_distributed()
    trainset = images(192)
    args = add_argument()
    model_engine, trainloader = build(args, trainset)
    rank = model_engine.global_rank
    half = len(trainloader)  # one epoch, then save
    losses, lrs = train(model_engine, trainloader, 1)
    model_engine.save_checkpoint(f"{args.out}/ckpt-{deepspeed.__name__}", client_state={"epoch": 1})
    more, more_lrs = train(model_engine, trainloader, 1)
    result = {
        "losses": losses + more,
        "lrs": lrs + more_lrs,
        "global_steps": model_engine.global_steps,
        "global_samples": model_engine.global_samples,
        "train_batch_size": model_engine.train_batch_size(),
        "micro": model_engine.train_micro_batch_size_per_gpu(),
        "accumulation": model_engine.gradient_accumulation_steps(),
        "world_size": model_engine.world_size,
        "grad_norm": model_engine.get_global_grad_norm(),
        "applied": model_engine.was_step_applied(),
        "skipped": model_engine.skipped_steps,
    }
    resumed_engine, resumed_loader = build(args, trainset)
    path, client_state = resumed_engine.load_checkpoint(f"{args.out}/ckpt-{deepspeed.__name__}")
    resumed, resumed_lrs = train(resumed_engine, resumed_loader, 1)
    result.update(
        resumed=resumed,
        resumed_lrs=resumed_lrs,
        client_state=client_state,
        half=half,
        resumed_steps=resumed_engine.global_steps,
    )
    write_result(args.out, rank, result)


if __name__ == "__main__":
    main()
