"""``engine.gathered_for_inference()``: generation under stage 3 gathers once, not per token.

Reference: the same model generating greedily in one plain process (no ZeRO). The
all-gathers are counted by zero_comm's ``CommLedger``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_full
import zero_full.inference
import zero_params
from zero_comm import CommLedger, Topology

NEW_TOKENS = 12


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    cfg = GPT2Config(
        n_layer=3, n_embd=20, n_head=2, vocab_size=53, n_positions=40, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg).eval()


def _all_gathers(ledger: CommLedger) -> int:
    return sum(1 for r in ledger.records if r.op == "all_gather")


def _generate(model, x):
    return model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )


def _generate_gathered(world_threshold: int) -> dict:
    ref = _model()
    x = torch.tensor([[5, 9, 2, 33], [1, 1, 7, 40]])
    with torch.no_grad():
        expected = _generate(ref, x)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": world_threshold}}
    engine = zero_full.initialize(copy.deepcopy(ref), config, lambda ps: torch.optim.SGD(ps, lr=0.1)).eval()
    try:
        with CommLedger(Topology()) as once:
            with engine.gathered_for_inference():
                got = _generate(engine.module, x)
        with CommLedger(Topology()) as per_token, torch.no_grad():
            got_hooks = _generate(engine.module, x)
        released = all(
            zero_params.state_of(p).status is zero_params.ParamStatus.NOT_AVAILABLE
            for p in engine.module.parameters()
            if not zero_params.state_of(p).persistent
        )
        engine.train()
        loss = engine(input_ids=x, labels=x).loss  # training still works after the context
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()
    return {
        "same": torch.equal(got, expected),
        "same_hooks": torch.equal(got_hooks, expected),
        "gathers_once": _all_gathers(once),
        "gathers_per_token": _all_gathers(per_token),
        "released": released,
        "loss_finite": bool(torch.isfinite(loss)),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("threshold", [0, 30])
def test_generate_gathered_once_gives_the_plain_tokens(dist, world, threshold):
    for r in dist.run(world, _generate_gathered, threshold):
        assert r["same"] and r["same_hooks"] and r["released"] and r["loss_finite"], r
        assert r["gathers_once"] == 1, r  # one coalesced all-gather: one strategy, dtype, device
        assert r["gathers_per_token"] >= NEW_TOKENS, r  # the hooks gather per forward, i.e. per token


def _too_small_budget() -> tuple[str, bool]:
    engine = zero_full.initialize(
        _model(), {"zero_optimization": {"stage": 3}}, lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    try:
        need = zero_full.inference.gathered_bytes(engine.module)
        with engine.gathered_for_inference(budget_bytes=need):  # exactly enough: fine
            pass
        try:
            with engine.gathered_for_inference(budget_bytes=need - 1):
                pass
        except ValueError as exc:
            msg = str(exc)
        nothing_gathered = all(
            zero_params.state_of(p).status is not zero_params.ParamStatus.AVAILABLE
            for p in engine.module.parameters()
            if not zero_params.state_of(p).persistent
        )
        return msg.replace(str(need), "<NEED>"), nothing_gathered
    finally:
        engine.close()


def test_a_budget_below_the_model_raises_naming_the_bytes_needed(dist):
    msg, nothing_gathered = dist.run(2, _too_small_budget)[0]
    assert "needs <NEED> bytes per rank; pass budget_bytes >= <NEED>" in msg and nothing_gathered
