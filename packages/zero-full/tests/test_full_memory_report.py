"""``engine.memory_report()`` / ``engine.reset_peak_memory()`` against the process and the formula."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import zero_full
from zero_full.memory.rank_memory import MemorySource

MIB = 1 << 20


def _statm_rss() -> int:
    """An independent RSS reading: resident pages of /proc/self/statm."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _report_at_each_stage(rank, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(257, 129), nn.Tanh(), nn.Linear(129, 7))
    psi = sum(p.numel() for p in model.parameters())
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    engine = zero_full.initialize(
        model, {"zero_optimization": zero}, lambda ps: torch.optim.AdamW(ps, lr=1e-3)
    )
    x = torch.randn(4, 257)
    engine.backward(engine(x).square().mean())
    engine.step()
    report = engine.memory_report()
    statm = _statm_rss()
    counted = engine.model_state_bytes()
    assert engine.reset_peak_memory()
    rest = engine.memory_report().process
    transient = torch.ones(64 * MIB, dtype=torch.uint8)  # 64 MiB: mmapped, returned when freed
    del transient
    after = engine.memory_report(reset_peak=True).process
    again = engine.memory_report().process
    engine.close()
    return psi, report, statm, rest, after, again, counted, str(report)


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 1), (4, 3)])
def test_report_reads_the_process_and_names_the_formula_of_the_stage(dist, world, stage):
    results = dist.run(world, _report_at_each_stage, stage)
    for rank, (psi, report, statm, rest, after, again, counted, text) in enumerate(results):
        assert report.rank == rank and report.global_steps == 1 and report.num_params == psi
        assert report.process.source is MemorySource.PROC_STATUS and report.process.peak_resettable
        assert abs(report.process.rss_bytes - statm) < 4 * MIB  # the process's RSS, read independently
        assert report.device is None  # CPU build
        formula = {1: 8 * psi + 8 * psi / world, 2: 4 * psi + 12 * psi / world, 3: 16 * psi / world}[stage]
        assert report.formula_bytes == pytest.approx(formula)
        assert report.formula.startswith(f"ZeRO-{stage} ") and f"N = {world}" in report.formula
        # The engine's own count is there as a second figure (after the step: no gradients).
        assert report.model_state_bytes == counted > 0
        # The peak after a reset saw the transient 64 MiB; the reset after reading forgot it.
        assert after.peak_rss_bytes - rest.rss_bytes >= 63 * MIB
        assert again.peak_rss_bytes < after.peak_rss_bytes - 48 * MIB
        assert f"rank {rank} step 1: RSS " in text and "since the last reset" in text
        assert f"by ZeRO-{stage}" in text


def _offload_report(rank):
    from zero_testing import captured_logs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(257, 129), nn.Tanh(), nn.Linear(129, 7))
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    with captured_logs("zero.engine", logging.INFO) as logs:
        engine = zero_full.initialize(model, {"zero_optimization": zero}, lambda ps: torch.optim.AdamW(ps))
    report = engine.memory_report()
    numel = sum(g.numel for g in engine.optimizer.groups)
    engine.close()
    return numel, report.offloaded_device_bytes, str(report), logs


def test_optimizer_offload_reports_what_it_keeps_off_the_device(dist):
    """On a CPU the device is the host: the moments (8 bytes per element of the partition) are counted;
    on an accelerator the master and gradient partition too (16 bytes, see zero-optim's tests)."""
    for rank, (numel, saved, text, logs) in enumerate(dist.run(2, _offload_report)):
        assert saved == numel * 8 > 0
        assert "kept off the device by optimizer offload" in text
        said = [m for m in logs if "optimizer offload keeps" in m]
        assert len(said) == (1 if rank == 0 else 0)
        if said:
            assert said[0] == (
                f"zero: optimizer offload keeps {saved} bytes per rank off cpu: optimizer state in "
                "pageable host memory"
            )
