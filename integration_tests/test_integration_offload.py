"""Optimizer-state and parameter offload (``offload_optimizer`` / ``offload_param``) train like no offload.

* Parity (DESIGN.md yardstick): stage 3 with ``offload_optimizer: nvme`` (small sub-groups,
  read and write pipelining) and stage 2 with ``offload_optimizer: cpu``, world 2, 20 AdamW
  steps: per-step losses within 1e-5 relative of a single process on the whole batch and of
  the same stage without offload; final parameters close to the non-offloaded run (the CPU
  Adam's fused kernel rounds differently from torch's per-tensor loop, a few ulp per step).
* fp16 (stage 1) and bf16 (stage 3) working parameters with nvme offload: the same losses
  as without offload (within 1e-3 relative; identical on this machine).
* Transfers are counted: one gradient slice down and one master slice up per sub-group and
  step, of exactly the partition's bytes.
* Bounded memory: with nvme, the optimizer state held in host memory (from storages) is at
  most the buffer pool plus one sub-group, while the whole state is >= 10x that.
* Faults: a corrupted swap file mid-training is an error naming the file and the tensor;
  an unusable or too small ``nvme_path`` fails ``initialize`` before the first step.
* Checkpoints save and load with nvme offload (state read back from and written to the swap files).
* Parameter offload: stage 3 with ``offload_optimizer: nvme`` + ``offload_param: nvme`` (a
  three-buffer shard cache) and with ``offload_param: cpu``, world 2, 20 steps: the same
  yardstick. Counted: one shard store per parameter and step, swap-ins started by the trace
  prefetch ahead of the gathers that use them (``prefetch_hits``), host memory for shards
  (from storages) at most the buffer pool while the shards are >= 10x that. Faults: a
  corrupted parameter swap file is an error naming file and parameter; an unusable or too
  small ``nvme_path`` fails ``initialize``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from models import build, global_batch, make_optimizer, mean_over_ranks, rank_slice, reference_run
from torch import nn

import zero_full
import zero_offload
import zero_optim
import zero_params
from zero_testing import assert_losses_close, assert_state_close

STEPS = 20
BATCH = 8


@functools.cache
def _reference() -> dict:
    return reference_run("mlp", "adamw", STEPS, BATCH)


def _config(stage: int, top: dict | None = None, **zero) -> dict:
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 300, **zero}, **(top or {})}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def offload_run(rank, stage: int, zero: dict, top: dict | None = None) -> dict:
    """Train the odd MLP with the engine on this rank's slices; losses and final full parameters."""
    world = dist.get_world_size()
    model = build("mlp")
    engine = zero_full.initialize(model, _config(stage, top, **zero), make_optimizer("adamw"))
    dtype = next(p for p in model.parameters()).dtype
    losses = []
    for step in range(STEPS):
        batch = rank_slice(global_batch("mlp", step, BATCH), rank.rank, world)
        loss = engine(*(t.to(dtype) for t in batch))
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.float().item()))
    with zero_params.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"losses": losses, "params": params}


def _small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 7))


def _nvme(path: Path, **extra) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "pipeline_read": True, "pipeline_write": True, **extra}


def _param_nvme(path: Path, **extra) -> dict:
    """Parameter offload to nvme with a tiny cache: 3 buffers of 540 elements (largest shard: 537)."""
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": 3, "buffer_size": 540, **extra}


CASES = [
    (3, lambda tmp: {"offload_optimizer": _nvme(tmp, buffer_count=3), "sub_group_size": 200}),
    (2, lambda tmp: {"offload_optimizer": {"device": "cpu"}, "overlap_comm": True}),
    (
        3,
        lambda tmp: {
            "offload_optimizer": _nvme(tmp / "opt", buffer_count=3),
            "offload_param": _param_nvme(tmp / "param"),
            "sub_group_size": 200,
            "stage3_prefetch_bucket_size": 300,
        },
    ),
    (3, lambda tmp: {"offload_param": {"device": "cpu"}}),
]


@pytest.mark.parametrize(
    "stage,zero", CASES, ids=["stage3-nvme", "stage2-cpu", "stage3-nvme-params-nvme", "stage3-params-cpu"]
)
def test_offloaded_optimizer_matches_single_process_and_no_offload(dist, tmp_path, stage, zero):
    """Losses within 1e-5 of one process and of the same stage without offload; ranks agree."""
    ref = _reference()
    plain = dist.run(2, offload_run, stage, {})
    results = dist.run(2, offload_run, stage, zero(tmp_path))
    assert results[0]["losses"] == results[1]["losses"]
    for n, p in results[1]["params"].items():
        assert torch.equal(p, results[0]["params"][n]), f"rank 1 holds another {n} than rank 0"
    assert_losses_close(results[0]["losses"], ref["losses"], rel=1e-5)
    assert_losses_close(results[0]["losses"], plain[0]["losses"], rel=1e-5)
    assert_state_close(results[0]["params"], plain[0]["params"], rel=1e-4)
    if "offload_optimizer" not in zero(tmp_path):  # torch's AdamW either way: parameter offload is exact
        assert results[0]["losses"] == plain[0]["losses"]
        for n, p in results[0]["params"].items():
            assert torch.equal(p, plain[0]["params"][n]), n
    assert list(tmp_path.rglob("*.zswap")) == []  # swap files removed by engine.close()


MIXED = [
    (1, {"fp16": {"enabled": True, "initial_scale_power": 8}}, False),
    (3, {"bf16": {"enabled": True}}, False),
    (3, {"bf16": {"enabled": True}}, True),
]


@pytest.mark.parametrize("stage,top,params", MIXED, ids=["stage1-fp16", "stage3-bf16", "stage3-bf16-params"])
def test_offload_with_16bit_working_parameters(dist, tmp_path, stage, top, params):
    """16-bit working copies refreshed from the offloaded fp32 masters: the same losses as no offload.

    With ``params``, the bf16 parameter shards are offloaded to nvme as well."""
    zero = {"offload_optimizer": _nvme(tmp_path, buffer_count=3)}
    if params:
        zero["offload_param"] = _param_nvme(tmp_path / "param")
    plain = dist.run(2, offload_run, stage, {}, top)[0]
    off = dist.run(2, offload_run, stage, zero, top)[0]
    assert_losses_close(off["losses"], plain["losses"], rel=1e-3)  # measured: identical here


def count_transfers(rank, tmp: str) -> dict:
    torch.manual_seed(0)
    model = _small_net()
    cfg = _config(3, offload_optimizer=_nvme(Path(tmp)), sub_group_size=100)
    engine = zero_full.initialize(model, cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for step in range(3):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    off = engine.optimizer.offload
    numel = sum(g.numel for g in engine.optimizer.groups)
    out = {
        "transfers": off.transfers,
        "numel": numel,
        "subgroups": len(off.subgroups),
        "swap": off.swapper.stats,
        "io_mode": off.swapper.io_mode.value,
    }
    engine.close()
    return out


def test_transfers_and_swap_bytes_are_counted(dist, tmp_path):
    """Per step and sub-group: one gradient slice down, one master slice up, 3 reads and 3 writes."""
    for r, res in enumerate(dist.run(2, count_transfers, str(tmp_path))):
        t, n, k = res["transfers"], res["numel"], res["subgroups"]
        assert k == -(-n // 100), f"rank {r}: {k} sub-groups for {n} elements"
        assert t.steps == 3
        assert t.grad_down == t.param_up == zero_offload.Transfers(3 * k, 3 * n * 4)
        s = res["swap"]
        assert s.reads == zero_offload.Transfers(3 * 3 * k, 3 * 3 * n * 4)
        assert s.writes == zero_offload.Transfers(3 * k + 3 * 3 * k, 4 * 3 * n * 4)  # initial + 3 steps


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, 256), *[nn.Linear(256, 256) for _ in range(3)], nn.Linear(256, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def bounded_memory(rank, tmp: str) -> dict:
    torch.manual_seed(0)
    cfg = _config(3, offload_optimizer=_nvme(Path(tmp), buffer_count=3), sub_group_size=1024)
    engine = zero_full.initialize(Wide(), cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for step in range(2):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        engine.step()
    opt = engine.optimizer
    held = [t for s in opt.torch_optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held += opt.offload.state_tensors()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    out = {
        "resident": sum(storages.values()),
        "pool": opt.offload._store.pool.resident_bytes,  # noqa: SLF001 - test inspects the pool
        "subgroup": 1024 * 4 * 3,
        "total": opt.offload.total_state_bytes,
    }
    engine.close()
    return out


def test_nvme_offload_bounds_resident_optimizer_state(dist, tmp_path):
    for r, res in enumerate(dist.run(2, bounded_memory, str(tmp_path))):
        bound = res["pool"] + res["subgroup"]
        assert res["resident"] <= bound, f"rank {r}: {res}"
        assert res["total"] >= 10 * bound, f"rank {r}: model too small to show the bound: {res}"


def _flip_payload_byte(path: Path) -> None:
    """Corrupt one byte of a swap file's payload (its header stays valid)."""
    data = bytearray(path.read_bytes())
    data[zero_offload.swap.HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_swap_file(engine, what: str) -> Path | str:
    """Flip a payload byte of the swap file of one optimizer state or parameter shard."""
    if what == "optimizer":
        victim = engine.optimizer.offload.swapper.path_of("g0.s1.exp_avg_sq")
    else:
        swapper = zero_optim.offloaded_shards(engine.optimizer).swapper
        if swapper.residence("0.weight") is not zero_offload.ShardResidence.ON_DISK:
            return "victim is resident: the corruption would not be read"
        victim = swapper.swapper.path_of("0.weight")
    _flip_payload_byte(victim)
    return victim


def corrupt_mid_training(rank, tmp: str, what: str) -> str:
    """Four steps with the swap file of ``what`` corrupted before the third; the error or "no error"."""
    torch.manual_seed(0)
    if what == "optimizer":
        cfg = _config(3, offload_optimizer=_nvme(Path(tmp)), sub_group_size=100)
    else:
        cfg = _config(3, offload_param=_param_nvme(Path(tmp), buffer_count=1))
    engine = zero_full.initialize(_small_net(), cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    victim = None
    for step in range(4):
        if step == 2:
            victim = _corrupt_swap_file(engine, what)
            if not isinstance(victim, Path):
                engine.close()
                return victim
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(step))
        try:
            engine.backward(engine(x).square().mean())
            engine.step()
        except zero_offload.SwapError as exc:
            engine.close()
            return f"step {step}: {exc}|{victim}"
    engine.close()
    return "no error"


@pytest.mark.parametrize(
    "what,name", [("optimizer", "g0.s1.exp_avg_sq"), ("param", "0.weight")], ids=["optimizer", "param"]
)
def test_corrupted_swap_file_mid_training_is_an_error_naming_it(dist, tmp_path, what, name):
    msg = dist.run(1, corrupt_mid_training, str(tmp_path), what)[0]
    text, victim = msg.split("|")
    assert text.startswith("step 2: "), msg
    assert victim in text and f"'{name}'" in text and "checksum" in text, msg


def initialize_error(rank, nvme_path: str, free: int | None, what: str) -> str:
    """Initialize with optimizer state or parameters swapped to ``nvme_path`` (``free`` bytes free)."""
    if what == "optimizer":
        cfg = _config(3, offload_optimizer=_nvme(Path(nvme_path)))
    else:
        cfg = _config(3, offload_param=_param_nvme(Path(nvme_path)))
    space = mock.patch("zero_offload.swap._free_bytes", lambda directory: free)
    try:
        with space if free is not None else contextlib.nullcontext():
            zero_full.initialize(_small_net(), cfg, lambda ps: torch.optim.AdamW(ps))
    except zero_offload.SwapError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "initialized"


@pytest.mark.parametrize("what,folder", [("optimizer", ""), ("param", "/params")], ids=["optimizer", "param"])
def test_unusable_or_too_small_nvme_path_fails_at_initialize(dist, tmp_path, what, folder):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for m in dist.run(2, initialize_error, str(blocker / "swap"), None, what):
        assert m.startswith("SwapError") and str(blocker) in m and "not usable" in m, m
    for r, m in enumerate(dist.run(2, initialize_error, str(tmp_path / "small"), 1000, what)):
        assert m.startswith("SwapSpaceError") and f"zero_rank{r}{folder}" in m, m
        assert "free, but swapping needs" in m, m


def checkpoint_roundtrip(rank, tmp: str, params: bool) -> dict:
    world = dist.get_world_size()
    cfg = _config(3, offload_optimizer=_nvme(Path(tmp) / "swap"), sub_group_size=150)
    if params:
        cfg["zero_optimization"]["offload_param"] = _param_nvme(Path(tmp) / "pswap")

    def train(engine, steps, first):
        losses = []
        for step in range(first, first + steps):
            loss = engine(*rank_slice(global_batch("mlp", step, BATCH), rank.rank, world))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    a = zero_full.initialize(build("mlp"), cfg, make_optimizer("adamw"))
    train(a, 3, 0)
    a.save_checkpoint(Path(tmp) / "ckpt", tag="t")
    cont = train(a, 3, 3)
    a.close()
    b = zero_full.initialize(build("mlp"), cfg, make_optimizer("adamw"))
    b.load_checkpoint(Path(tmp) / "ckpt", tag="t")
    resumed = train(b, 3, 3)
    b.close()
    return {"cont": cont, "resumed": resumed}


@pytest.mark.parametrize("params", [False, True], ids=["optimizer", "optimizer+params"])
def test_checkpoint_with_nvme_offload_resumes_exactly(dist, tmp_path, params):
    for res in dist.run(2, checkpoint_roundtrip, str(tmp_path), params):
        assert res["resumed"] == res["cont"]


# --------------------------------------------------------------------------- parameter offload


class Deep(nn.Module):
    """24 layers of 128 x 128: parameter shards >= 10x a two-buffer cache."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(128, 128) for _ in range(24)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


PARAM_STEPS = 3


def param_offload_counts(rank, tmp: str) -> dict:
    torch.manual_seed(0)
    zero = {"offload_param": _param_nvme(Path(tmp), buffer_count=2, buffer_size=128 * 64)}
    cfg = _config(3, stage3_prefetch_bucket_size=128 * 128, **zero)
    model = Deep()
    engine = zero_full.initialize(model, cfg, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    shards = zero_optim.offloaded_shards(engine.optimizer)
    peak = 0
    for step in range(PARAM_STEPS):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        peak = max(peak, shards.swapper.resident_elements)
        engine.step()
    held = shards.host_tensors() + [zero_params.state_of(p).shard for p in model.parameters()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    out = {
        "stats": dataclasses.asdict(shards.stats),
        "coord": engine.coordinator.total_stats,
        "resident": sum(storages.values()),
        "pool": shards.swapper._pool.resident_bytes,  # noqa: SLF001 - test inspects the pool
        "shard_bytes": sum(s.partition_numel * 4 for s in shards.states),
        "count": len(shards.states),
        "peak": peak,
    }
    engine.close()
    return out


def test_param_offload_prefetches_counts_transfers_and_bounds_host_memory(dist, tmp_path):
    """Every step stores each shard once; swap-ins are issued by the trace prefetch before the gathers
    that use them; host memory for shards is the two-buffer pool while the shards are >= 10x that."""
    for r, res in enumerate(dist.run(2, param_offload_counts, str(tmp_path))):
        st, coord = res["stats"], res["coord"]
        assert res["count"] == 48
        assert st["stores"] == {"count": PARAM_STEPS * 48, "nbytes": PARAM_STEPS * res["shard_bytes"]}
        assert st["prefetched"] == coord.shard_prefetches > 0, f"rank {r}: {st}"
        assert 0 < st["prefetch_hits"] <= st["prefetched"], f"rank {r}: {st}"
        assert st["fetches"]["count"] >= PARAM_STEPS * 48, f"rank {r}: {st}"  # every shard gathered each step
        assert st["swap_ins"]["count"] <= st["fetches"]["count"] + st["prefetched"]
        assert st["max_resident_elements"] <= 2 * 128 * 64 and res["peak"] <= 2 * 128 * 64
        assert res["resident"] <= res["pool"], f"rank {r}: {res}"
        assert res["shard_bytes"] >= 10 * res["pool"], f"rank {r}: model too small to show the bound: {res}"
