"""``zero_full.memory.rank_memory``: RSS and its peak against independent readings of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from zero_full.memory import rank_memory
from zero_full.memory.rank_memory import (
    MemorySource,
    read_device_memory,
    read_process_memory,
    reset_device_peak,
)

MIB = 1 << 20

# Runs in a fresh interpreter with MALLOC_MMAP_THRESHOLD_ set, so that freed blocks leave the RSS.
_PROBE = textwrap.dedent(
    """
    import json, os, torch
    from zero_full.memory.rank_memory import read_process_memory, reset_process_peak

    def statm_rss():  # an independent reading: resident pages of /proc/self/statm
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    out = {}
    rest = read_process_memory()
    out["rest"], out["rest_statm"] = rest.rss_bytes, statm_rss()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page written
    held = read_process_memory()
    out["held"], out["held_statm"], out["held_peak"] = held.rss_bytes, statm_rss(), held.peak_rss_bytes
    del block
    out["freed"] = read_process_memory().rss_bytes
    out["reset"] = reset_process_peak()
    out["peak_after_reset"] = read_process_memory().peak_rss_bytes
    transient = torch.ones(48 << 20, dtype=torch.uint8)  # 48 MiB, freed before the next reading
    del transient
    after = read_process_memory()
    out["after_rss"], out["after_peak"] = after.rss_bytes, after.peak_rss_bytes
    out["source"], out["resettable"] = after.source.value, after.peak_resettable
    print(json.dumps(out))
    """
)


def _probe() -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode:
        raise AssertionError(f"probe process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rss_follows_a_64_mib_tensor_and_the_peak_resets_to_catch_a_transient():
    out = _probe()
    assert out["source"] == MemorySource.PROC_STATUS.value and out["resettable"] and out["reset"]
    # RSS agrees with /proc/self/statm (another file, counted in pages) within a few pages.
    for ours, statm in ((out["rest"], out["rest_statm"]), (out["held"], out["held_statm"])):
        assert abs(ours - statm) < MIB, (ours, statm)
    assert 63 * MIB <= out["held"] - out["rest"] <= 68 * MIB
    assert out["held_peak"] >= out["held"] - MIB  # the kernel updates the peak lazily, by a few pages
    assert out["held"] - out["freed"] >= 63 * MIB  # mmapped block returned at once
    # After the reset the peak is today's RSS, not the 64 MiB block's; the transient 48 MiB shows.
    assert out["peak_after_reset"] < out["held_peak"] - 48 * MIB
    assert out["after_peak"] - out["after_rss"] >= 47 * MIB
    assert abs(out["after_rss"] - out["freed"]) < 4 * MIB


def test_without_proc_the_peak_comes_from_getrusage_and_says_it_cannot_reset(monkeypatch):
    with_proc = read_process_memory()
    monkeypatch.setattr(rank_memory, "_PROC_STATUS", "/nonexistent/status")
    fallback = read_process_memory()
    assert fallback.source is MemorySource.GETRUSAGE
    assert fallback.rss_bytes is None and not fallback.peak_resettable
    # ru_maxrss is the process's lifetime peak: at least the RSS /proc reported just before.
    assert fallback.peak_rss_bytes >= with_proc.rss_bytes - MIB


def test_device_memory_is_none_on_a_cpu_only_build():
    import torch

    if torch.accelerator.is_available():  # pragma: no cover - CI runs on CPU
        before = read_device_memory()
        block = torch.ones(16 * MIB, dtype=torch.uint8, device=torch.accelerator.current_accelerator())
        assert read_device_memory().allocated_bytes - before.allocated_bytes >= 16 * MIB
        del block
        assert reset_device_peak()
        assert read_device_memory().peak_allocated_bytes < before.allocated_bytes + 16 * MIB
    else:
        assert read_device_memory() is None and reset_device_peak() is False
