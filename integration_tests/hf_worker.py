"""Hugging Face Trainer trainings of the tiny GPT-2: ``python hf_worker.py OUT.json [options]``.

``torchrun --nproc_per_node 2 hf_worker.py OUT.json --stage 3`` trains with ``ZeroTrainer``;
without ``--stage`` it is the single-process reference (plain ``Trainer``, the whole global
batch per device). Rank 0 writes the Trainer's log history and, under zero, the learning
rate and gradient norm the engine used at each step. ``--lora`` trains PEFT LoRA adapters on
the frozen model; ``--generate`` records the greedy tokens ``generate`` gives after training.
``OUT1.json [options] --then OUT2.json [options] ...`` runs several trainings one after the
other in the same processes, each with its own ``Trainer``.
"""

from __future__ import annotations

import json

import torch
from trainer_models import BUILDERS, TokenDataset, token_data, worker_parser
from transformers import Trainer, TrainerCallback, TrainingArguments

from zero_testing.scripts import run_each, write_from_rank_0


class EngineRecorder(TrainerCallback):
    """The engine's learning rate (read after the step, before the scheduler moves it) and gradient norm."""

    def __init__(self) -> None:
        self.trainer = None
        self.steps: list[dict[str, float]] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        engine = self.trainer.engine
        self.steps.append({"lr": engine.optimizer.param_groups[0]["lr"], "grad_norm": engine.grad_norm})


def train(argv: list[str]) -> None:
    """One ``Trainer.train`` (and ``evaluate``) as ``argv`` says; rank 0 writes its JSON file."""
    ap = worker_parser()
    ap.add_argument("--stage", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--output-dir", default="hf_out")
    ap.add_argument("--save-model", default=None)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters on the frozen model")
    ap.add_argument("--generate", action="store_true", help="record greedy tokens after training")
    ap.add_argument("--config", default=None, help="a zero config JSON (default: the stage with auto values)")
    args = ap.parse_args(argv)

    targs = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=11,
        dataloader_drop_last=True,
        disable_tqdm=True,
        optim="adamw_torch",
        per_device_eval_batch_size=args.batch,
    )
    model = BUILDERS[args.model]()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(99)
        targets = ["c_attn", "c_fc"] if args.model == "gpt2" else ["q_proj", "v_proj", "up_proj"]
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        model = get_peft_model(model, lora)
    data = TokenDataset(token_data())
    recorder = EngineRecorder()
    if args.stage is None:
        trainer = Trainer(
            model=model, args=targs, train_dataset=data, eval_dataset=TokenDataset(token_data(16))
        )
    else:
        from zero_full.hf_trainer import ZeroTrainer

        config = (
            json.load(open(args.config))
            if args.config
            else {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": args.stage},
            }
        )
        if args.stage == 3 and not args.config:  # shard every tensor of the tiny model (none kept whole)
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        trainer = ZeroTrainer(
            model=model,
            args=targs,
            train_dataset=data,
            eval_dataset=TokenDataset(token_data(16)),
            callbacks=[recorder],
            zero_config=config,
        )
        recorder.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume)
    result = {"log": trainer.state.log_history, "engine": recorder.steps}
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
    if args.stage == 3:
        import zero_params

        frozen = [p for p in model.parameters() if not p.requires_grad]
        # sharded: partitioned and not kept whole as persistent
        sharded = [zero_params.is_partitioned(p) and not zero_params.state_of(p).persistent for p in frozen]
        result["frozen_sharded"] = [sum(sharded), len(sharded)]
        int8 = [isinstance(zero_params.state_of(p).offload, zero_params.FrozenInt8Store) for p in frozen]
        result["frozen_int8"] = [sum(int8), len(int8)]
    if args.generate:
        prompt = token_data(3)[:, :5]
        kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
        tokens = trainer.generate(prompt, **kw) if args.stage else trainer.model.eval().generate(prompt, **kw)
        result["tokens"] = tokens.tolist()
    if args.save_model and args.lora and args.stage == 3:
        # count the elements save_model gathers: the adapter's, never the frozen base's
        import zero_full.checkpoint.consolidate as consolidate
        import zero_params

        real, gathered = consolidate.gather_full, []

        def counting(piece):
            gathered.append(piece.numel)
            return real(piece)

        consolidate.gather_full = counting
        trainer.save_model(args.save_model)
        consolidate.gather_full = real
        numel = {n: zero_params.full_shape(p).numel() for n, p in model.named_parameters()}
        result["save_gathered"] = sum(gathered)
        result["numel"] = [sum(numel[n] for n in result["trainable"]), sum(numel.values())]
    elif args.save_model:
        trainer.save_model(args.save_model)
    write_from_rank_0(args.out, result)


if __name__ == "__main__":
    run_each(train)
