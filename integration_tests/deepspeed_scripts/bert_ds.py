"""DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py call sequence, shrunk.

A RoBERTa masked-LM (2 layers, hidden 32, vocabulary 300, no dropout) on synthetic masked
sequences, with the script's DeepSpeed calls in its order: ``initialize(model=,
model_parameters=model.parameters(), config=ds_config)`` with the script's config (Adam,
``train_micro_batch_size_per_gpu``, ZeRO stage 1; fp32, no CPU offload and ``torch_adam``
here, so that the comparison is exact and DeepSpeed compiles no Adam kernel), ``load_checkpoint(load_dir=)``
returning ``(path, client_state)``, ``train()``, forward / ``backward`` / ``step``, and
``save_checkpoint(save_dir=, client_state={'checkpoint_step': step})`` every
``checkpoint_every`` steps and at the end. The second run resumes from the first save.

Usage: ``torchrun --nproc-per-node 2 bert_ds.py OUT`` (``DS_IMPL`` picks the module).
"""

from __future__ import annotations

import os
import pathlib
import sys
from functools import partial

import torch
import torch.nn as nn
from common import deepspeed_module, tokens, write_result
from torch.utils.data import DataLoader
from transformers.models.roberta import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

deepspeed = deepspeed_module()
VOCAB, SEQ = 300, 16


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def collate_function(batch, pad_token_id: int) -> dict[str, torch.Tensor]:
    src = torch.LongTensor([ids for ids, _ in batch])
    tgt = torch.LongTensor([labels for _, labels in batch])
    return {"src_tokens": src, "tgt_tokens": tgt, "attention_mask": src.ne(pad_token_id).type_as(src)}


class InfiniteIterator:
    def __init__(self, iterable) -> None:
        self._iterable = iterable
        self._iterator = iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(batch_size: int) -> InfiniteIterator:
    loader = DataLoader(
        tokens(96, SEQ, VOCAB),
        batch_size=batch_size,
        shuffle=True,
        collate_fn=partial(collate_function, pad_token_id=1),
        generator=torch.Generator().manual_seed(int(os.environ.get("RANK", "0"))),
    )
    return InfiniteIterator(loader)


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config: RobertaConfig, embedding_weight: torch.Tensor | None = None) -> None:
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features: torch.Tensor, masked_token_indices: torch.Tensor | None = None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel) -> None:
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens) -> torch.Tensor:
        sequence_output, *_ = self.encoder(
            input_ids=src_tokens, attention_mask=attention_mask, return_dict=False
        )
        masked = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        scores = self.lm_head(sequence_output, masked)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked)
        return nn.CrossEntropyLoss(ignore_index=-1)(scores.view(-1, self.config.vocab_size), target)


def create_model() -> RobertaMLMModel:
    torch.manual_seed(42)
    roberta_config_dict = {
        "attention_probs_dropout_prob": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_dropout_prob": 0.0,
        "hidden_size": 32,
        "intermediate_size": 64,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": SEQ + 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "pad_token_id": 1,
        "type_vocab_size": 1,
        "vocab_size": VOCAB,
    }
    config = RobertaConfig.from_dict(roberta_config_dict)
    return RobertaMLMModel(config, RobertaModel(config))


def train(exp_dir: pathlib.Path, load_tag: str | None, num_iterations: int, checkpoint_every: int):
    device = torch.device("cpu")
    batch_size = 4
    data_iterator = create_data_iterator(batch_size)
    model = create_model()
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    client_state = None
    if load_tag is not None:
        _, client_state = model.load_checkpoint(load_dir=exp_dir, tag=load_tag)
        start_step = client_state["checkpoint_step"] + 1
        for _ in range(start_step - 1):  # the data the first run consumed
            next(data_iterator)
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return losses, client_state, model


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    exp_dir = out / f"bert-{deepspeed.__name__}"
    losses, _, model = train(exp_dir, None, 22, 8)
    rank = model.global_rank
    resumed, client_state, _ = train(exp_dir, "global_step8", 22, 8)
    write_result(
        out,
        rank,
        {
            "losses": losses,
            "resumed": resumed,
            "client_state": client_state,
            "global_steps": model.global_steps,
            "latest": (exp_dir / "latest").read_text(),
        },
    )


if __name__ == "__main__":
    torch.manual_seed(42)
    main()
