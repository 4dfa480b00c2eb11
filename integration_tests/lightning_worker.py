"""Lightning trainings of the tiny GPT-2, as a script: ``python lightning_worker.py OUT.json [options]``.

Run as ``torchrun --nproc_per_node 2 lightning_worker.py OUT.json --strategy zero_stage_3 ...`` for
zero and with ``--strategy auto`` in one process for the reference. Rank 0 writes each step's
loss, the learning rate the step used and the engine's gradient norm to the JSON file.
``OUT1.json [options] --then OUT2.json [options] ...`` runs several trainings one after the
other in the same processes (one launch, one process group), each with its own ``Trainer``.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainer_models import BUILDERS, token_data, worker_parser

import zero_params
from zero_testing.scripts import run_each, write_from_rank_0


class LitGPT2(pl.LightningModule):
    def __init__(self, lr: float, sharded: bool, model: str = "gpt2") -> None:
        super().__init__()
        self.lr = lr
        self.build = BUILDERS[model]
        self.net = None if sharded else self.build()
        self.records: list[dict[str, float]] = []
        self.partitioned = False

    def configure_model(self) -> None:
        if self.net is None:  # inside zero_full.Init under the zero strategies
            self.net = self.build()
            self.partitioned = all(zero_params.is_partitioned(p) for p in self.net.parameters())

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=ids).loss
        mean = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")  # the global batch's loss
        self.records.append({"loss": mean.item(), "lr": self.trainer.optimizers[0].param_groups[0]["lr"]})
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            self.records[-1]["grad_norm"] = engine.grad_norm

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train(argv: list[str]) -> None:
    """One ``Trainer.fit`` (and ``validate``) as ``argv`` says; rank 0 writes its JSON file."""
    ap = worker_parser()
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--config", default=None, help="a zero config as JSON: ZeroStrategy(config=...)")
    args = ap.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    zero = args.strategy.startswith("zero") or args.config is not None
    if zero:
        import zero_full.lightning  # noqa: F401  registers the strategy names
    data = token_data()

    def loader(samples: torch.Tensor) -> DataLoader:
        # rank r trains on samples r, r + world, ...: global batch k = the reference's batch k
        # (Lightning's own distributed sampler would shuffle the training data)
        dataset = TensorDataset(samples)
        sampler = DistributedSampler(dataset, world, int(os.environ.get("RANK", "0")), shuffle=False)
        return DataLoader(dataset, batch_size=args.batch, sampler=sampler)

    strategy = args.strategy
    if args.config:
        from zero_full.lightning import ZeroStrategy

        strategy = ZeroStrategy(config=json.loads(args.config))
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_epochs=1, save_top_k=-1))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, precision=args.precision,
        callbacks=callbacks, logger=False, use_distributed_sampler=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model = LitGPT2(lr=1e-3, sharded=zero, model=args.model)
    trainer.fit(model, train_dataloaders=loader(data), ckpt_path=args.resume)
    result = {"records": model.records, "partitioned": model.partitioned}
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:  # the settings the engine ran with
        result["zero_optimization"] = engine.config.zero_optimization.model_dump(mode="json", by_alias=True)
        result["mics"] = engine.mics is not None
        # sharded: partitioned and not kept whole as a persistent parameter
        params = list(model.net.parameters())
        kept = [zero_params.is_partitioned(p) and not zero_params.state_of(p).persistent for p in params]
        result["sharded"] = [sum(kept), len(params)]
        numels = [zero_params.full_shape(p).numel() for p in params]
        result["split_numels"] = sorted(n for n, k in zip(numels, kept) if k)
        result["whole_numels"] = sorted(n for n, k in zip(numels, kept) if not k)
    if args.validate:
        val = loader(data[:16])
        result["val_loss"] = trainer.validate(model, dataloaders=val, verbose=False)[0]["val_loss"]
    write_from_rank_0(args.out, result)


if __name__ == "__main__":
    run_each(train)
