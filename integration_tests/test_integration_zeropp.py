"""ZeRO++ convergence: a tiny GPT-2 (Hugging Face, built from a config) learns a synthetic task at
2 simulated nodes x 2 ranks in bf16 with each ZeRO++ variant, and stays within a measured
tolerance of plain ZeRO-3.

The task: each sequence follows ``x[t+1] = (5 * x[t] + 3) % 61`` from a random start, so the next
token is a function of the current one (the loss falls from ln(64) ~ 4.2 to ~0.009 in 120
steps). Two figures per run, over the 4 ranks: the final loss (mean of the last 20 steps) and the
mean loss over all 120 steps (how fast it learned; the final loss alone is ~0 for every run).

Measured on the 2-core CI machine (gloo, 120 steps, AdamW lr 1e-2, bf16), the mean loss of each
variant is within 0.62% of plain ZeRO-3 (qgz+loco; the others within 0.52%), so the bound is 2%.
The final losses are ~0.009 and differ by at most 0.0007: a relative bound there measures noise,
so the final-loss check is 2% or 0.005 absolute, whichever is larger.
"""

from __future__ import annotations

import os

import pytest
import torch

import zero_full

VOCAB, SEQ, MICRO, TAIL = 64, 8, 4, 20
STEPS = int(os.environ.get("ZEROPP_CONV_STEPS", 120))
REL_TOL = 0.02  # the bound on |final(variant) - final(plain)| / final(plain)
ABS_FLOOR = 0.005  # |difference| below this passes whatever the ratio (both runs converged)
MEAN_REL_TOL = 0.02  # on the mean loss over the run (measured at most 0.62%)
TIMEOUT = 600.0


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.empty(MICRO, SEQ, dtype=torch.long)
    x[:, 0] = torch.randint(0, 61, (MICRO,), generator=g)
    for t in range(1, SEQ):
        x[:, t] = (5 * x[:, t - 1] + 3) % 61
    return x


def _run(rank, zero: dict) -> list[float]:
    config = {
        "bf16": {"enabled": True},
        # 4 ranks building GPT-2 on a loaded CI machine: tolerate slow starts (silent peer: 5 x 10 s)
        "robustness": {"heartbeat_interval": 10},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000, **zero},
    }
    model = _model()
    engine = zero_full.initialize(model, config, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0))
    losses = []
    for step in range(STEPS):
        x = _batch(step, rank.rank)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close()
    return losses


def _final(results: list[list[float]]) -> float:
    return sum(sum(losses[-TAIL:]) / TAIL for losses in results) / len(results)


def _mean(results: list[list[float]]) -> float:
    """Mean loss over the whole run and every rank: how fast it learned, not only where it ended."""
    return sum(sum(losses) / len(losses) for losses in results) / len(results)


VARIANTS = {
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qgz": {"zero_quantized_gradients": True},
    "qgz+loco": {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
    "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}


@pytest.fixture(scope="module")
def plain_final(dist):
    results = dist.run(4, _run, {}, ranks_per_node=2, timeout=TIMEOUT)
    return _final(results), results


@pytest.mark.parametrize("name", list(VARIANTS))
def test_zeropp_variant_converges_like_plain_zero3(dist, plain_final, name):
    zero = VARIANTS[name]
    plain, plain_runs = plain_final
    assert plain < 0.5 * sum(r[0] for r in plain_runs) / len(plain_runs)  # the task is learned
    runs = dist.run(4, _run, zero, ranks_per_node=2, timeout=TIMEOUT)
    final, mean, plain_mean = _final(runs), _mean(runs), _mean(plain_runs)
    print(
        f"zeropp convergence: {name} final {final:.4f} vs plain {plain:.4f}; "
        f"mean {mean:.4f} vs plain {plain_mean:.4f} ({(mean - plain_mean) / plain_mean:+.2%})"
    )
    assert abs(final - plain) <= max(REL_TOL * plain, ABS_FLOOR), (name, final, plain)
    assert abs(mean - plain_mean) <= MEAN_REL_TOL * plain_mean, (name, mean, plain_mean)
