"""The cluster benchmark: variant availability, configs, the report table and the docs section."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.cluster import BLOCK, VARIANTS, report, unavailable, zero_config


def test_variants_release_parameters_and_detect_what_zero_full_implements():
    cfg = zero_config(VARIANTS["MiCS shard = node"])
    assert cfg["bf16"] == {"enabled": True}
    z = cfg["zero_optimization"]
    assert (z["stage"], z["mics_shard_size"], z["stage3_param_persistence_threshold"]) == (3, 2, 0)
    assert unavailable("DDP") is None
    assert unavailable("ZeRO-3") is None
    assert unavailable("MiCS shard = node") is None
    for name in ("qwZ", "hpZ", "qgZ", "qwZ + hpZ + qgZ"):
        why = unavailable(name)
        assert why is None or why.startswith("not available in this build"), why


def _row(name, seconds, ledger, model, veth):
    return {
        "variant": name,
        "status": "ran",
        "model_bytes_M": 100,
        "step_seconds_median": seconds,
        "ledger_inter_bytes_per_rank": ledger,
        "ledger_backward_gather_inter_bytes_per_rank": None if ledger is None else 75,
        "pair_model_node_egress_bytes": [model, model],
        "veth_node_egress_bytes": [veth, veth],
    }


def test_report_table_and_docs_section(tmp_path):
    pytest.importorskip("matplotlib")
    args = argparse.Namespace(layers=1, width=8, vocab=11, seq=3, micro=1, warmup=0, steps=1)
    rows = [
        _row("DDP", 1.0, None, 150, 151),
        _row("ZeRO-3", 2.0, 225, 250, 255),
        {"variant": "qwZ", "status": "not available in this build (x)"},
    ]
    link = {"rate_mbit": 20.0, "burst_kib": 64, "delay": "none", "description": "20 Mbit/s link"}
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text(f"# B\n\n{BLOCK.begin}\nold\n{BLOCK.end}\n\ntail\n")
    report(args, rows, link, "python -m benchmarks cluster").write(tmp_path, docs)
    md = (tmp_path / "cluster.md").read_text()
    assert "| ZeRO-3 | 2000 | 1.00 | 2.250 | 0.750 | 2.500 | 2.550 | +2.0% |" in md
    assert "| DDP | 1000 | 2.00 | torch DDP (no ledger) |  | 1.500 | 1.510 | +0.7% |" in md
    assert "| qwZ | not available in this build (x) |" in md
    assert json.loads((tmp_path / "cluster.json").read_text())["meta"]["link"]["rate_mbit"] == 20.0
    assert (tmp_path / "cluster.png").stat().st_size > 0
    page = (docs / "benchmarks.md").read_text()
    assert "old" not in page and "| ZeRO-3 | 2000 |" in page and page.endswith(f"{BLOCK.end}\n\ntail\n")
    assert "![cluster](assets/benchmarks/cluster.png)" in page
    assert (docs / "assets" / "benchmarks" / "cluster.png").exists()
