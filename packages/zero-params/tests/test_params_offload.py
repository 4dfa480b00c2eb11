"""OffloadedShards: gathers read offloaded shards (cpu / nvme), edits are written back, copies work."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from params_cases import reference_partition, run
from torch import nn

import zero_params as zp
from zero_offload import OffloadTarget, ParamOffloadConfig, ShardResidence

pytest_plugins = ("params_worlds",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 11))


def _config(device: str, tmp: str) -> ParamOffloadConfig:
    if device == "cpu":
        return ParamOffloadConfig(device=OffloadTarget.CPU)
    return ParamOffloadConfig(device=OffloadTarget.NVME, nvme_path=Path(tmp), buffer_count=2, buffer_size=64)


def _gather_edit_copy(device: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    zp.partition(model, persistence_threshold=3)  # the 3-element bias stays whole, not offloaded
    params = list(model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        home = zp.OffloadedShards(
            params, _config(device, tmp), names={p: n for n, p in model.named_parameters()}
        )
        names = [n for n, p in model.named_parameters() if zp.state_of(p).offload is home]
        placeholders = [zp.state_of(p).shard.numel() == 0 for p in params if zp.state_of(p).offload is home]
        with zp.GatheredParameters(params):
            seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        gathered_ok = all(torch.equal(seen[n], ref[n]) for n in ref)
        with zp.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p in params:
                p.add_(1.0)
        with zp.GatheredParameters(params):
            edited_ok = all(torch.equal(p, ref[n] + 1.0) for n, p in model.named_parameters())
        clone = copy.deepcopy(model)
        with zp.GatheredParameters(list(clone.parameters())):
            copy_ok = all(torch.equal(p, ref[n] + 1.0) for n, p in clone.named_parameters())
        shard = home.upload([zp.state_of(params[0])])[0]
        shard_ok = torch.equal(shard, reference_partition(ref["0.weight"] + 1.0, world, rank))
        stats = home.stats
        residence = [home.swapper.residence(k) for k in home.swapper.keys()]
        home.close()
    return names, placeholders, gathered_ok, edited_ok, copy_ok, shard_ok, stats, residence


def test_gathers_read_offloaded_shards_and_edits_are_written_back(dist, world):
    for device in ("cpu", "nvme"):
        for names, placeholders, *oks, stats, residence in run(dist, world, _gather_edit_copy, device):
            assert names == ["0.weight", "0.bias", "1.weight", "2.weight", "2.bias"]  # 1.bias: persistent
            assert all(oks), (device, oks)
            assert all(placeholders) == (device == "nvme"), placeholders
            assert stats.stores.count == len(names)  # the modifier write-back, one per offloaded shard
            if device == "nvme":
                assert sum(r is not ShardResidence.ON_DISK for r in residence) <= 2
                assert stats.swap_ins.count > 0
