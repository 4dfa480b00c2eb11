"""``benchmarks.kit``: tables, result files, byte and memory counters, spawned ranks."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.kit.measure import peak_rss_bytes, read_wchar, reset_peak_rss, rss_bytes, spawn_ranks
from benchmarks.kit.report import environment, markdown_table, write_results


def test_markdown_table_aligns_columns_and_checks_row_widths():
    text = markdown_table(["name", "ms"], [["a", "1.0"], ["b", 2]], align="lr")
    assert text.splitlines() == ["| name | ms |", "|---|---:|", "| a | 1.0 |", "| b | 2 |"]
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(["name", "ms"], [["a"]])
    with pytest.raises(ValueError, match="one letter per column"):
        markdown_table(["name", "ms"], [], align="l")


def test_write_results_writes_json_and_markdown(tmp_path):
    paths = write_results(tmp_path / "out", "demo", {"rows": [1, 2]}, "| a |")
    assert [p.name for p in paths] == ["demo.json", "demo.md"]
    assert json.loads(paths[0].read_text()) == {"rows": [1, 2]}
    assert paths[1].read_text() == "| a |\n"
    assert [p.name for p in write_results(tmp_path, "only", {})] == ["only.json"]


def test_wchar_counts_bytes_written(tmp_path):
    before = read_wchar()
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    assert read_wchar() - before >= 100_000


def test_peak_rss_follows_an_allocation_and_resets():
    block = bytearray(64 << 20)
    block[::4096] = b"\1" * len(block[::4096])  # touch every page
    assert rss_bytes() >= 64 << 20
    before = peak_rss_bytes()  # the kernel updates the peak lazily: it may lag the RSS by a few pages
    assert before >= 64 << 20
    del block  # a large block goes back to the kernel at once
    if reset_peak_rss():
        assert peak_rss_bytes() < before - (32 << 20)


def test_environment_names_versions_and_cores():
    env = environment("no-such-distribution-xyz")
    assert env["cpus"] >= 1 and env["versions"]["torch"]
    assert env["versions"]["no-such-distribution-xyz"] is None


def _answer_from_rank_one(rank, args, store, results):
    if rank == 1:
        results.put({"args": args, "store_named": store.endswith("/store")})


def _rank_one_dies(rank, args, store, results):
    if rank == 1:
        raise SystemExit(3)
    time.sleep(120)


def test_spawn_ranks_returns_the_result_one_rank_puts():
    assert spawn_ranks(_answer_from_rank_one, 2, "x", timeout=60) == {"args": "x", "store_named": True}


def test_spawn_ranks_names_a_rank_that_dies_instead_of_waiting():
    # Rank 0 would block for 120 s; the dead rank is reported (and rank 0 killed) at once,
    # not as the timeout the wait would end in.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="benchmark failed: rank 1 raised SystemExit: 3"):
        spawn_ranks(_rank_one_dies, 2, None, timeout=120)
    assert time.monotonic() - start < 100
