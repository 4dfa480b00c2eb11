"""AsyncSwapper and BufferPool: round trips, accounting, data safety, start-up checks, cleanup."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from zero_offload import (
    ALIGNMENT,
    AsyncSwapper,
    BufferPool,
    IoMode,
    SwapError,
    SwapSpaceError,
    Transfers,
    aligned_empty,
    detect_io_mode,
    payload_checksum,
)
from zero_offload.swap import HEADER_BYTES, SUFFIX

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]
NUMELS = [0, 1, 7, 1023, 4096, 5003]


def _tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + numel)
    return (torch.randn(numel, generator=gen) * 100).to(dtype)


@pytest.fixture(params=list(IoMode), ids=lambda m: m.value)
def swapper(request, tmp_path):
    mode = request.param
    if mode is IoMode.DIRECT and detect_io_mode(tmp_path) is not IoMode.DIRECT:
        mode = IoMode.BUFFERED  # the filesystem has no O_DIRECT: the buffered path is what runs
    with AsyncSwapper(tmp_path / "swap", io_mode=mode) as s:
        yield s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_of_odd_shapes_and_dtypes(swapper, dtype):
    """Unaligned tensors, aligned pool memory and shapes with dims all come back bit-identical."""
    for numel in NUMELS:
        t = _tensor(numel, dtype)
        shaped = t.reshape(1, numel, 1)
        swapper.write(f"t{numel}", shaped).wait()
        out = torch.empty_like(shaped)
        swapper.read(f"t{numel}", out).wait()
        assert torch.equal(out, shaped)
        nbytes = numel * t.element_size()
        aligned = aligned_empty(nbytes + 16)[:nbytes].view(dtype) if numel else torch.empty(0, dtype=dtype)
        swapper.read(f"t{numel}", aligned).wait()
        assert torch.equal(aligned, t)


def test_byte_accounting_and_many_requests_in_flight(swapper):
    tensors = {f"x{i}": _tensor(1000 + i, torch.float32, i) for i in range(16)}
    handles = [swapper.write(k, v) for k, v in tensors.items()]
    for h in handles:
        h.wait()
    assert all(h.done() for h in handles)
    outs = {k: torch.empty_like(v) for k, v in tensors.items()}
    for h in [swapper.read(k, outs[k]) for k in tensors]:
        h.wait()
    total = sum(v.numel() * 4 for v in tensors.values())
    s = swapper.stats
    assert s.writes == s.reads == Transfers(16, total)
    assert all(torch.equal(outs[k], tensors[k]) for k in tensors)


def test_overwrite_replaces_the_file(swapper):
    swapper.write("w", torch.ones(7)).wait()
    swapper.write("w", torch.full((7,), 2.0)).wait()
    out = torch.empty(7)
    swapper.read("w", out).wait()
    assert torch.equal(out, torch.full((7,), 2.0))


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupt_truncated_missing_or_foreign_files_are_errors_naming_file_and_tensor(swapper):
    t = _tensor(1023, torch.float32)
    for name in ("pay", "head", "cut", "gone", "other"):
        swapper.write(name, t).wait()
    out = torch.empty_like(t)
    cases = {
        "pay": (lambda p: _flip(p, HEADER_BYTES + 100), "payload checksum mismatch"),
        "head": (lambda p: _flip(p, 20), "header checksum mismatch"),
        "cut": (lambda p: os.truncate(p, HEADER_BYTES + 10), "truncated"),
        "gone": (lambda p: p.unlink(), "missing"),
    }
    for name, (damage, what) in cases.items():
        path = swapper.path_of(name)
        damage(path)
        with pytest.raises(SwapError, match=what) as info:
            swapper.read(name, out).wait()
        assert str(path) in str(info.value) and repr(name) in str(info.value)
    with pytest.raises(
        SwapError, match=r"holds tensor 'other' \(1023 x float32\), expected 'other' \(1023 x int64\)"
    ):
        swapper.read("other", torch.empty(1023, dtype=torch.int64)).wait()
    with pytest.raises(SwapError, match="no swap file was written for tensor 'never'"):
        swapper.read("never", out)


def test_unusable_directory_and_too_little_space_fail_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SwapError, match=f"swap directory {blocker / 'sub'} is not usable"):
        AsyncSwapper(blocker / "sub")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(
        SwapSpaceError, match=f"swap directory {tmp_path / 'big'} has .* free, but swapping needs"
    ):
        AsyncSwapper(tmp_path / "big", required_bytes=free + 2**30)
    with pytest.raises(SwapSpaceError, match=r"\(5000 bytes\)"):
        AsyncSwapper(tmp_path / "tiny", required_bytes=5000, free_bytes=lambda d: 4999)
    AsyncSwapper(tmp_path / "fits", required_bytes=5000, free_bytes=lambda d: 5000).close()


def test_files_removed_on_close_and_stale_files_on_start(tmp_path):
    d = tmp_path / "swap"
    s = AsyncSwapper(d)
    s.write("a", torch.ones(3)).wait()
    s.write("b", torch.ones(5)).wait()
    assert len(list(d.glob(f"*{SUFFIX}"))) == 2
    s.close()
    assert list(d.glob(f"*{SUFFIX}")) == []
    s.close()  # idempotent
    crashed = AsyncSwapper(d)
    crashed.write("c", torch.ones(3)).wait()
    (d / "keep.txt").write_text("not ours")
    leftover = crashed.path_of("c")
    crashed._finalizer.detach()  # noqa: SLF001 - simulate a crash: no cleanup ran
    assert leftover.exists()
    AsyncSwapper(d).close()
    assert not leftover.exists() and (d / "keep.txt").exists()


def test_garbage_collected_swapper_removes_its_files(tmp_path):
    d = tmp_path / "gc"
    s = AsyncSwapper(d)
    s.write("a", torch.ones(3)).wait()
    del s
    import gc

    gc.collect()
    assert list(d.glob(f"*{SUFFIX}")) == []


def test_direct_io_mode_is_detected_not_assumed(tmp_path):
    mode = detect_io_mode(tmp_path)
    assert mode in (IoMode.DIRECT, IoMode.BUFFERED)
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(tmp_path / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT)
            os.close(fd)
            opens = True
        except OSError:
            opens = False
        if not opens:
            assert mode is IoMode.BUFFERED
    assert not (tmp_path / ".zero_direct_io_probe").exists()


def test_buffer_pool_is_aligned_bounded_and_blocks_when_empty():
    pool = BufferPool(2, 5000)
    assert pool.buffer_bytes == 2 * ALIGNMENT
    assert all(b.data_ptr() % ALIGNMENT == 0 and b.numel() == 2 * ALIGNMENT for b in pool.buffers)
    assert pool.resident_bytes == 2 * (2 * ALIGNMENT + ALIGNMENT)
    a, b = pool.acquire(), pool.acquire()
    assert pool.free_count == 0 and a.data_ptr() != b.data_ptr()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    pool.release(a)
    waiter.join(timeout=10)
    assert got and got[0].data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b) or pool.release(b)
    with pytest.raises(ValueError, match="not a buffer of this pool"):
        pool.release(torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer_count >= 1"):
        BufferPool(0, 10)


def test_payload_checksum_catches_bit_flips_and_reordering():
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (3 * 4096 + 13,), dtype=torch.uint8, generator=gen)
    base = payload_checksum(data)
    assert payload_checksum(data.clone()) == base
    for pos in (0, 7, 4095, 4096 + 7, 2 * 4096 + 3, 3 * 4096 + 12):  # incl. top byte of a word, the tail
        for bit in (0, 7):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            assert payload_checksum(flipped) != base, (pos, bit)
    swapped = data.clone()
    swapped[:4096], swapped[4096:8192] = data[4096:8192].clone(), data[:4096].clone()
    assert payload_checksum(swapped) != base
    unaligned = data[1:]  # not 8-byte aligned: same bytes, same checksum as a fresh copy
    assert payload_checksum(unaligned) == payload_checksum(unaligned.clone())
    assert payload_checksum(torch.empty(0)) == (0, 0)
    assert payload_checksum(torch.tensor([1.5], dtype=torch.bfloat16)) != payload_checksum(
        torch.tensor([1.25], dtype=torch.bfloat16)
    )
