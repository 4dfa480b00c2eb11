"""Sharded checkpoints: manifest, re-partitioning, atomicity, mismatch and corruption errors,
``consolidated_state_dict`` and ``zero consolidate``."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

import zero_full
from zero_comm import partition_numel, shard_range
from zero_full import checkpoint
from zero_full.checkpoint import io as ckpt_io
from zero_full.checkpoint.safetensors import SafetensorsWriter
from zero_full.cli.main import main as cli_main
from zero_testing import raised_message

BATCH = 8


class Odd(nn.Module):
    """Odd shapes (numel 1, 7, primes), a frozen parameter and a buffer."""

    def __init__(self, wide: int = 13, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a = nn.Linear(11, wide)
        self.b = nn.Linear(wide, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)
        self.register_buffer("offset", torch.arange(5, dtype=torch.float32))
        if extra:
            self.c = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) * self.scale + self.frozen[:3] + self.offset[:3]
        return ((h - y) ** 2).mean()


def _optimizer(params):
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    )


def _data(step, rank, world):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _engine(stage=3, **model_kw):
    cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return zero_full.initialize(Odd(**model_kw), cfg, _optimizer)


def _train(engine, steps, start=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + steps):
        loss = engine(*_data(step, rank, world))
        engine.backward(loss)
        engine.step()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


# --------------------------------------------------------------------------- save / manifest


def _save_and_describe(rank, root):
    engine = _engine()
    _train(engine, 3)
    path = engine.save_checkpoint(root)
    sd = engine.consolidated_state_dict()
    shard = torch.load(path / ckpt_io.shard_file_name(rank.rank), weights_only=True)
    pieces = {n: (e["start"], e["stop"], e["value"].clone()) for n, e in shard["params"].items()}
    groups = {seg.name: gi for gi, g in enumerate(engine.optimizer.groups) for seg in g.segments}
    engine.close()
    return {"path": str(path), "sd": sd, "pieces": pieces, "groups": groups}


@pytest.mark.smoke
def test_manifest_describes_the_checkpoint_and_files_hold_their_ranges(dist, tmp_path):
    res = dist.run(2, _save_and_describe, str(tmp_path))
    path = Path(res[0]["path"])
    assert path == tmp_path / "global_step3"
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest"]  # no temporaries left
    m = json.loads((path / "manifest.json").read_text())
    assert (m["format"], m["format_version"], m["world_size"], m["stage"]) == ("zero-checkpoint", 2, 2, 3)
    assert (m["global_steps"], m["micro_steps"]) == (3, 3)
    assert m["config"]["zero_optimization"]["stage"] == 3
    params = {p["name"]: p for p in m["params"]}
    sizes = {"a.weight": 143, "a.bias": 13, "b.weight": 39, "b.bias": 3, "scale": 1, "frozen": 7}
    assert set(params) == set(sizes)
    for name, numel in sizes.items():
        part = params[name]["partitioning"]
        assert part == {"numel": numel, "partition_numel": partition_numel(numel, 2), "world": 2}
    assert params["frozen"]["trainable"] is False and params["frozen"]["optimizer_group"] is None
    groups = res[0]["groups"]
    assert sorted(set(groups.values())) == [0, 1] and set(groups) == set(sizes) - {"frozen"}
    assert {n: params[n]["optimizer_group"] for n in groups} == groups
    assert params["a.weight"]["shape"] == [13, 11] and params["a.weight"]["dtype"] == "float32"
    opt = m["optimizer"]
    assert opt["type"] == "AdamW"
    assert [g["hyperparameters"]["lr"] for g in opt["groups"]] == [1e-2, 3e-3]
    assert [g["hyperparameters"]["weight_decay"] for g in opt["groups"]] == [0.01, 0.0]
    assert opt["groups"][0]["scalar_state"]["step"] == {"tensor": True, "dtype": "float32", "value": 3.0}
    assert opt["groups"][0]["elementwise_state"] == {"exp_avg": "float32", "exp_avg_sq": "float32"}
    assert m["buffers"] == [{"name": "offset", "shape": [5], "dtype": "float32"}]
    files = {f["name"]: f for f in m["files"]}
    assert set(files) == {"rank00000.pt", "rank00001.pt", "buffers.pt", "extras.pt"}
    for name, f in files.items():
        assert ckpt_io.file_digest(path / name) == (f["size"], f["sha256"])
    full = res[0]["sd"]
    assert res[1]["sd"] == {}
    for r in (0, 1):
        assert {tuple(p) for p in files[f"rank0000{r}.pt"]["pieces"]} == {
            (n, *shard_range(numel, 2, r)) for n, numel in sizes.items()
        }
        for name, (start, stop, value) in res[r]["pieces"].items():
            assert (start, stop) == shard_range(sizes[name], 2, r)
            torch.testing.assert_close(value, full[name].reshape(-1)[start:stop], rtol=0, atol=0)


def _save_twice(rank, root):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="one")
    error = raised_message(checkpoint.CheckpointError, engine.save_checkpoint, root, tag="one")
    engine.close()
    return error


def test_saving_over_an_existing_tag_is_an_error_on_every_rank(dist, tmp_path):
    errors = dist.run(2, _save_twice, str(tmp_path))
    assert all(e is not None and "exists already" in e and "one" in e for e in errors), errors


# --------------------------------------------------------------------------- resume / reshard


def _train_save_continue(rank, root, stage):
    engine = _engine(stage)
    _train(engine, 3)
    engine.save_checkpoint(root, tag="t")
    torch.manual_seed(99 + rank.rank)  # the checkpoint holds the RNG state from before this
    after = _train(engine, 4, start=3)
    sd = engine.consolidated_state_dict()
    engine.close()
    return {"after": after, "sd": sd}


def _load_continue(rank, root, stage):
    engine = _engine(stage)
    torch.manual_seed(12345)
    engine.load_checkpoint(root)
    rng_after_load = torch.get_rng_state()
    steps = engine.global_steps
    losses = _train(engine, 4, start=3)
    sd = engine.consolidated_state_dict()
    engine.close()
    return {"after": losses, "sd": sd, "rng": rng_after_load, "steps": steps}


def _rng_saved(rank, root):
    shard = torch.load(Path(root) / "t" / ckpt_io.shard_file_name(rank.rank), weights_only=True)
    return shard["rng"]["torch_cpu"]


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 2), (2, 1), (2, 4), (4, 2)])
def test_load_repartitions_to_any_world_size(dist, tmp_path, save_world, load_world):
    ref = dist.run(save_world, _train_save_continue, str(tmp_path), 3)
    got = dist.run(load_world, _load_continue, str(tmp_path), 3)
    assert got[0]["steps"] == 3
    if save_world == load_world:
        assert got[0]["after"] == ref[0]["after"]  # bit-exact resume
        for r, saved in enumerate(dist.run(load_world, _rng_saved, str(tmp_path))):
            assert torch.equal(got[r]["rng"], saved)  # each rank's RNG restored
    else:
        torch.testing.assert_close(got[0]["after"], ref[0]["after"], rtol=1e-5, atol=1e-6)
    for name, value in ref[0]["sd"].items():
        torch.testing.assert_close(got[0]["sd"][name], value, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- atomicity


def _failing_save(rank, root):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="good")
    _train(engine, 1, start=1)
    real = ckpt_io.write_torch

    def half_then_fail(obj, path):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a shard")
        raise OSError(28, "No space left on device (injected)")

    if rank.rank == 1:
        ckpt_io.write_torch = half_then_fail
    try:
        error = raised_message(checkpoint.CheckpointError, engine.save_checkpoint, root, tag="bad")
    finally:
        ckpt_io.write_torch = real
    # The engine is still usable and the old checkpoint still loads.
    engine.load_checkpoint(root)
    steps = engine.global_steps
    engine.close()
    return {"error": error, "steps": steps}


def test_a_save_failing_on_one_rank_leaves_the_previous_checkpoint(dist, tmp_path):
    res = dist.run(2, _failing_save, str(tmp_path))
    for r in res:
        assert r["error"] is not None and "rank 1 could not write checkpoint file" in r["error"], r
        assert "rank00001.pt" in r["error"] and "disk full" in r["error"] and "injected" in r["error"], r
        assert r["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest"]
    assert (tmp_path / "latest").read_text() == "good"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killed_save_rank(rank, world, port, root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="good")
    if rank == 1:
        real = ckpt_io.write_torch

        def die(obj, path):
            real(obj, path)
            os._exit(17)  # killed in the middle of the save, after writing its shard

        ckpt_io.write_torch = die
    try:
        checkpoint.save_checkpoint(engine.train_state(), root, tag="bad", timeout=20.0)
    except checkpoint.CheckpointError as exc:
        results.put((rank, str(exc)))
    else:
        results.put((rank, None))


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_killed_save_rank, args=(r, 2, port, str(tmp_path), results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert procs[1].exitcode == 17
    rank, error = results.get(timeout=5)
    assert rank == 0 and error is not None and "gave up waiting" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest"]
    assert (tmp_path / "latest").read_text() == "good"
    m = checkpoint.Manifest.read(tmp_path / "good")
    for entry in m.files:
        ckpt_io.verify_file(tmp_path / "good" / entry.name, entry)


# --------------------------------------------------------------------------- errors


def _save_plain(rank, root):
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(root)
    sd = engine.consolidated_state_dict()
    engine.close()
    return sd


def _load_error(rank, root, model_kw):
    engine = _engine(**model_kw)
    error = raised_message(checkpoint.CheckpointError, engine.load_checkpoint, root)
    engine.close()
    return error


def test_a_checkpoint_that_does_not_match_the_model_lists_every_mismatch(dist, tmp_path):
    dist.run(2, _save_plain, str(tmp_path))
    errors = dist.run(2, _load_error, str(tmp_path), {"wide": 17, "extra": True})
    for e in errors:
        assert e is not None and "does not match the model (5 problem(s))" in e, e
        assert "missing in the checkpoint: parameter 'c.weight'" in e
        assert "missing in the checkpoint: parameter 'c.bias'" in e
        assert "shape mismatch: parameter 'a.weight' is [17, 11] here, [13, 11] saved" in e
        assert "shape mismatch: parameter 'a.bias' is [17] here, [13] saved" in e
        assert "shape mismatch: parameter 'b.weight' is [3, 17] here, [3, 13] saved" in e
        assert "optimizer groups" not in e


def test_unexpected_parameters_are_listed(dist, tmp_path):
    engine_kw = {"extra": True}
    dist.run(2, _save_extra, str(tmp_path), engine_kw)
    errors = dist.run(2, _load_error, str(tmp_path), {})
    for e in errors:
        assert "unexpected in the checkpoint: parameter 'c.weight' (not in the model)" in e, e
        assert "unexpected in the checkpoint: parameter 'c.bias' (not in the model)" in e


def _save_extra(rank, root, model_kw):
    engine = _engine(**model_kw)
    engine.save_checkpoint(root)
    engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_shard_file_is_named_on_every_rank(dist, tmp_path, damage):
    dist.run(2, _save_plain, str(tmp_path))
    victim = tmp_path / "global_step2" / "rank00001.pt"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 3 :]
    victim.write_bytes(bytes(data))
    errors = dist.run(2, _load_error, str(tmp_path), {})
    for e in errors:
        assert e is not None and str(victim) in e, e
        assert ("corrupt" if damage == "flip" else "truncated") in e
    out = tmp_path / "out.safetensors"
    assert cli_main(["consolidate", str(tmp_path), str(out)]) == 1
    assert not out.exists()


def test_loading_without_a_checkpoint_names_the_missing_latest(dist, tmp_path):
    errors = dist.run(2, _load_error, str(tmp_path), {})
    assert all("latest" in e and "does not exist" in e for e in errors), errors


# --------------------------------------------------------------------------- consolidation


def test_consolidate_cli_output_loads_into_a_plain_model(dist, tmp_path, capsys):
    sd = dist.run(2, _save_plain, str(tmp_path))[0]
    out = tmp_path / "model.safetensors"
    assert cli_main(["consolidate", str(tmp_path), str(out), "--tag", "global_step2"]) == 0
    printed = capsys.readouterr().out
    assert "7 tensors" in printed
    nbytes = out.stat().st_size  # a few kB: shown as such, not as "0.00 MiB"
    assert re.search(r"7 tensors, \d+(\.\d)? (B|kB) from checkpoint tag", printed), printed
    assert "MiB" not in printed and nbytes < 100_000
    loaded = safetensors.torch.load_file(str(out))
    assert list(loaded) == list(Odd().state_dict())
    assert loaded.keys() == sd.keys()
    for k in sd:
        assert torch.equal(loaded[k], sd[k]), k
    plain = Odd()
    plain.load_state_dict(loaded)  # strict: every key, every shape
    assert not torch.equal(plain.a.weight, Odd().a.weight)  # trained weights, not the init


def test_safetensors_writer_round_trips_odd_tensors(tmp_path):
    tensors = {
        "empty": torch.zeros(0, 3),
        "one": torch.tensor([1.5]),
        "prime": torch.randn(1023),
        "bf16": torch.randn(7, 5).to(torch.bfloat16),
        "ints": torch.arange(-3, 4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        w = SafetensorsWriter(f, [(k, v.dtype, v.shape) for k, v in tensors.items()], {"k": "v"})
        for k, v in tensors.items():
            w.write(k, v)
        w.finish()
    loaded = safetensors.torch.load_file(str(path))
    assert list(loaded) == sorted(tensors) or set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_safetensors_writer_refuses_out_of_order_and_missing_tensors(tmp_path):
    with open(tmp_path / "y.safetensors", "wb") as f:
        w = SafetensorsWriter(f, [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
        with pytest.raises(ValueError, match="expected tensor 'a'"):
            w.write("b", torch.zeros(3))
        w.write("a", torch.zeros(2))
        with pytest.raises(ValueError, match="1 declared tensor"):
            w.finish()


# --------------------------------------------------------------------------- mixed precision


def _fp16_engine():
    cfg = {
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2},
    }
    return zero_full.initialize(Odd(), cfg, _optimizer)


def _train_half(engine, steps, start):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(start, start + steps):
        loss = engine(*(t.half() for t in _data(step, rank, world)))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _fp16_resume(rank, root):
    engine = _fp16_engine()
    _train_half(engine, 4, 0)
    engine.save_checkpoint(root)
    saved = (engine.stats.loss_scale, engine.stats.skipped_steps)
    expected = _train_half(engine, 4, 4)
    engine.close()
    fresh = _fp16_engine()
    fresh.load_checkpoint(root)
    restored = (fresh.stats.loss_scale, fresh.stats.skipped_steps)
    got = _train_half(fresh, 4, 4)
    fresh.close()
    return {"saved": saved, "restored": restored, "expected": expected, "got": got}


def test_fp16_loss_scaler_state_is_saved_and_resumed_exactly(dist, tmp_path):
    res = dist.run(2, _fp16_resume, str(tmp_path))[0]
    m = json.loads((tmp_path / "global_step4" / "manifest.json").read_text())
    scale, skipped = res["saved"]
    assert skipped > 0  # 2**20 overflows fp16 at first: the scaler has real state to restore
    assert m["loss_scaler"]["scale"] == scale and m["loss_scaler"]["skipped_steps"] == skipped
    assert res["restored"] == res["saved"]
    assert res["got"] == res["expected"]


# --------------------------------------------------------------------------- read planning


@pytest.mark.parametrize(("saved_world", "world"), [(4, 2), (2, 4), (3, 3), (4, 1)])
def test_each_rank_reads_only_the_pieces_overlapping_its_partition(saved_world, world):
    sizes = {"one": 1, "seven": 7, "prime": 1021, "empty": 0}
    files = [
        checkpoint.FileEntry(
            ckpt_io.shard_file_name(r),
            0,
            "",
            r,
            tuple((n, *shard_range(numel, saved_world, r)) for n, numel in sizes.items()),
        )
        for r in range(saved_world)
    ]
    for rank in range(world):
        wanted = {n: shard_range(numel, world, rank) for n, numel in sizes.items()}
        plan = checkpoint.plan_reads(files, wanted)
        for name, numel in sizes.items():
            lo, hi = wanted[name]
            got = sorted((a, b) for items in plan.values() for n, a, b in items if n == name)
            saved = [shard_range(numel, saved_world, r) for r in range(saved_world)]
            expected = sorted((a, b) for a, b in saved if set(range(a, b)) & set(range(lo, hi)))
            assert got == expected, (name, rank)
            covered = sum(min(b, hi) - max(a, lo) for a, b in got)
            assert covered == hi - lo  # the pieces read cover the new partition exactly
    # world 4 -> 2: rank 0 holds elements [0, 511) of the prime: saved ranks 0 and 1 only.
    if (saved_world, world) == (4, 2):
        plan = checkpoint.plan_reads(files, {n: shard_range(v, 2, 0) for n, v in sizes.items()})
        assert sorted(plan) == ["rank00000.pt", "rank00001.pt"]


# --------------------------------------------------------------------------- a subset of parameters


def _trainable_only(rank):
    engine = _engine()
    _train(engine, 2)
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    full = engine.consolidated_state_dict()
    part = engine.consolidated_state_dict(params=trainable)
    engine.close()
    return full, part, trainable


@pytest.mark.parametrize("world", [1, 2])
def test_consolidated_state_dict_of_named_parameters_only(dist, world):
    """``params=``: only those parameters (the frozen one and the buffer left out), equal to
    the whole consolidation's tensors, on rank 0; ``{}`` elsewhere."""
    results = dist.run(world, _trainable_only)
    full, part, trainable = results[0]
    assert sorted(part) == sorted(trainable) and "frozen" not in part and "offset" not in part
    for name, tensor in part.items():
        assert torch.equal(tensor, full[name]), name
    assert all(p == {} for _, p, _ in results[1:])
