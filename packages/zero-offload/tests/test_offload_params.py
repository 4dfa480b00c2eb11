"""ParamSwapper: round trips, the residence bound, prefetch before fetch, errors naming the shard."""

from __future__ import annotations

import pytest
import torch

from zero_offload import (
    ALIGNMENT,
    OffloadTarget,
    ParamOffloadConfig,
    ParamSwapper,
    ShardResidence,
    SwapError,
    SwapSpaceError,
    Transfers,
    align_up,
)

SIZES = [7, 1, 333, 64, 5, 129]


def _values(seed: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _swapper(tmp_path, **kw) -> ParamSwapper:
    cfg = ParamOffloadConfig(device=OffloadTarget.NVME, nvme_path=tmp_path, **kw)
    shards = [
        (f"layer{i}.weight", n, torch.float32 if i % 2 else torch.bfloat16) for i, n in enumerate(SIZES)
    ]
    sw = ParamSwapper(cfg, shards)
    for i, (key, n, dtype) in enumerate(shards):
        sw.store(key, _values(i, n, dtype))
    sw.flush()
    return sw


def test_nvme_round_trip_and_residence_bound(tmp_path):
    sw = _swapper(tmp_path, buffer_count=2, buffer_size=512)
    keys = sw.keys()
    for _ in range(2):
        for i, key in enumerate(keys):
            (out,) = sw.fetch([key])
            assert torch.equal(out, _values(i, SIZES[i], out.dtype))
            assert sw.residence(key) is ShardResidence.RESIDENT
            sw.unpin([key])
            assert sw.stats.max_resident_elements <= 2 * 512
    assert sum(sw.residence(k) is not ShardResidence.ON_DISK for k in keys) <= 2
    # two buffers of 512 fp32 elements, each rounded up to a page, plus a page of alignment slack
    assert sw.resident_bytes == 2 * (align_up(512 * 4) + ALIGNMENT)
    assert sw.stats.evictions >= len(keys)
    assert sw.stats.fetches.count == 2 * len(keys)
    # store writes new values that the next swap-in returns
    new = _values(99, SIZES[2], torch.bfloat16)
    sw.store(keys[2], new)
    sw.flush()
    sw.evict_all()
    assert sw.residence(keys[2]) is ShardResidence.ON_DISK
    (out,) = sw.fetch([keys[2]])
    assert torch.equal(out, new)
    sw.unpin([keys[2]])
    path = sw.swapper.path_of(keys[2])
    sw.close()
    assert not path.exists()


def test_max_in_cpu_bounds_resident_elements(tmp_path):
    sw = _swapper(tmp_path, buffer_count=6, buffer_size=512, max_in_cpu=400)
    for key in sw.keys():
        sw.fetch([key])
        sw.unpin([key])
        assert sw.resident_elements <= 400
    assert sw.stats.max_resident_elements <= 400
    sw.close()


def test_prefetch_issues_reads_before_the_fetch(tmp_path):
    sw = _swapper(tmp_path, buffer_count=3, buffer_size=512)
    sw.evict_all()
    keys = sw.keys()
    started = sw.prefetch((k, True) for k in keys[:3])
    assert started == 3 and sw.stats.swap_ins.count == 3
    assert {sw.residence(k) for k in keys[:3]} <= {ShardResidence.SWAPPING_IN, ShardResidence.RESIDENT}
    # no room for more without evicting prefetched shards: prefetch stops, never blocks
    assert sw.prefetch((k, True) for k in keys[3:]) == 0
    outs = sw.fetch(keys[:3])
    assert sw.stats.prefetch_hits == 3 and sw.stats.swap_ins.count == 3  # no second read
    for i, out in enumerate(outs):
        assert torch.equal(out, _values(i, SIZES[i], out.dtype))
    # pinned shards are never evicted: a fourth shard does not fit
    with pytest.raises(RuntimeError, match="no room to swap in 'layer3.weight'.*buffer_count = 3"):
        sw.fetch([keys[3]])
    sw.unpin(keys[:3])
    # shards named earlier in the same call (needed sooner) are not evicted for later ones
    assert sw.prefetch([(keys[0], False), (keys[1], False), (keys[3], True), (keys[4], True)]) == 1
    assert (
        sw.residence(keys[0]) is ShardResidence.RESIDENT and sw.residence(keys[1]) is ShardResidence.RESIDENT
    )
    assert sw.residence(keys[2]) is ShardResidence.ON_DISK  # the one not named: evicted for keys[3]
    assert sw.residence(keys[4]) is ShardResidence.ON_DISK
    (out,) = sw.fetch([keys[3]])
    assert torch.equal(out, _values(3, SIZES[3])) and sw.stats.prefetch_hits == 4
    sw.close()


def test_cpu_keeps_every_shard_resident_and_counts_transfers():
    cfg = ParamOffloadConfig(device=OffloadTarget.CPU)
    sw = ParamSwapper(cfg, [("a", 5, torch.float32), ("b", 3, torch.float64)])
    sw.store("a", torch.arange(5.0))
    sw.store("b", torch.ones(3, dtype=torch.float64))
    assert sw.prefetch([("a", True), ("b", True)]) == 0
    a, b = sw.fetch(["a", "b"])
    assert torch.equal(a, torch.arange(5.0)) and torch.equal(b, torch.ones(3, dtype=torch.float64))
    assert sw.stats.fetches == Transfers(2, 5 * 4 + 3 * 8) and sw.stats.stores.count == 2
    assert sw.residence("a") is ShardResidence.RESIDENT and sw.resident_bytes == 5 * 4 + 3 * 8


def test_corrupt_swap_file_names_file_and_shard(tmp_path):
    sw = _swapper(tmp_path, buffer_count=2, buffer_size=512)
    sw.evict_all()
    path = sw.swapper.path_of("layer2.weight")
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\xff\xfe")
    with pytest.raises(SwapError, match=rf"{path}.*'layer2.weight'.*corrupt"):
        sw.fetch(["layer1.weight", "layer2.weight"])
    assert all(sw.residence(k) is not ShardResidence.SWAPPING_IN for k in sw.keys())
    (out,) = sw.fetch(["layer1.weight"])  # the swapper stays usable
    assert torch.equal(out, _values(1, SIZES[1]))
    sw.close()


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="'big' has 600 elements, more than buffer_size = 512"):
        ParamSwapper(
            ParamOffloadConfig(device=OffloadTarget.NVME, nvme_path=tmp_path, buffer_size=512),
            [("big", 600, torch.float32)],
        )
    with pytest.raises(ValueError, match="nvme_path"):
        ParamOffloadConfig(device=OffloadTarget.NVME)
    with pytest.raises(ValueError, match="buffer_count must be >= 1"):
        ParamOffloadConfig(buffer_count=0)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SwapError, match="not usable"):
        ParamSwapper(
            ParamOffloadConfig(device=OffloadTarget.NVME, nvme_path=blocker), [("a", 4, torch.float32)]
        )
    huge = 2**50  # elements: more than any disk; refused before any buffer is allocated
    cfg = ParamOffloadConfig(
        device=OffloadTarget.NVME, nvme_path=tmp_path / "p", buffer_size=huge, max_in_cpu=huge
    )
    with pytest.raises(SwapSpaceError, match="free"):
        ParamSwapper(cfg, [("a", huge, torch.float32)])
