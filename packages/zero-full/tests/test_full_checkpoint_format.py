"""The typed manifest keeps the on-disk format: checkpoints written before it still load; checkpoint
exchanges give up after ``robustness.comm_timeout`` when a rank stops taking part."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import zero_full
from zero_full import checkpoint

# Written by the checkpoint code before the Manifest type (commit a49cfa5: zero_full/checkpoint.py),
# at world size 2, stage 3, after 2 steps of test_full_checkpoint's model; expected.pt holds
# that run's consolidated_state_dict and counters.
FIXTURE = Path(__file__).parent / "full_fixtures" / "ckpt_format1"


def test_manifest_round_trips_byte_for_byte():
    text = (FIXTURE / "v1" / "manifest.json").read_text(encoding="utf-8")
    manifest = checkpoint.Manifest.from_json(text)
    rewritten = manifest.to_json()
    # A format-1 manifest is re-written as the current format: the same content plus its digest.
    old, new = json.loads(text), json.loads(rewritten)
    assert (old.pop("format_version"), new.pop("format_version")) == (1, checkpoint.io.FORMAT_VERSION)
    assert new.pop("manifest_sha256") and new == old
    assert checkpoint.Manifest.from_json(rewritten).to_json() == rewritten
    assert (manifest.world_size, manifest.stage, manifest.global_steps) == (2, 3, 2)
    assert manifest.param("a.weight").shape == (13, 11) and manifest.param("nope") is None
    assert [f.name for f in manifest.files] == ["rank00000.pt", "buffers.pt", "rank00001.pt"]


def _engine(comm_timeout: float | None = None):
    from test_full_checkpoint import Odd, _optimizer

    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if comm_timeout is not None:
        # The engine-call check would meet the silent rank first (its own fault tests cover
        # that); without it the checkpoint's exchanges are the ones that wait.
        cfg["robustness"] = {"comm_timeout": comm_timeout, "check_calls": False}
    return zero_full.initialize(Odd(), cfg, _optimizer)


def _load_old(rank, root):
    engine = _engine()
    engine.load_checkpoint(root)
    sd = engine.consolidated_state_dict()
    steps = (engine.global_steps, engine.micro_steps)
    engine.close()
    return sd, steps


def _check_old_checkpoint_loads(dist, world, tmp_path):
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    results = dist.run(world, _load_old, str(root))
    sd, steps = results[0]
    assert steps == (expected["global_steps"], expected["micro_steps"]) == (2, 2)
    assert sd.keys() == expected["state_dict"].keys()
    for k, v in expected["state_dict"].items():
        assert torch.equal(sd[k], v), k
    assert all(r[1] == steps for r in results)


def test_a_checkpoint_written_before_the_manifest_type_loads_at_world_1(dist, tmp_path):
    _check_old_checkpoint_loads(dist, 1, tmp_path)


def test_a_checkpoint_written_before_the_manifest_type_loads_at_world_2(dist, tmp_path):
    _check_old_checkpoint_loads(dist, 2, tmp_path)


# --------------------------------------------------------------------------- a rank that stops


def _silent_rank(rank, world, store, root, results, done):
    """Both ranks save ``good``; then rank 1 stops taking part and rank 0 saves and loads alone.

    The ``good`` save runs under a generous timeout, so a slow machine cannot fail it; only the
    engine rank 0 then saves and loads with carries the 3 s ``comm_timeout`` under test. Anything
    unexpected is reported through ``results``, never left for the parent to wait out."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        patient = _engine(comm_timeout=120.0)
        patient.save_checkpoint(root, tag="good")
        patient.close()
        dist.barrier()
        engine = _engine(comm_timeout=3.0)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        results.put(("setup", traceback.format_exc(), 0.0))
        _exit(results, 1)
    if rank == 1:  # stops taking part: no save, no load; alive until rank 0 is done
        done.wait(timeout=300)
        os._exit(0)
    for what, call in (
        ("save", lambda: engine.save_checkpoint(root, tag="bad")),
        ("load", lambda: engine.load_checkpoint(root, tag="good")),
    ):
        start = time.monotonic()
        try:
            call()
        except checkpoint.CheckpointError as exc:
            results.put((what, str(exc), time.monotonic() - start))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((what, traceback.format_exc(), time.monotonic() - start))
        else:
            results.put((what, None, 0.0))
    done.set()
    _exit(results, 0)


def _exit(results, code: int) -> None:
    """Flush ``results``' feeder thread (``os._exit`` would drop what it still holds), then exit."""
    results.close()
    results.join_thread()
    os._exit(code)


def _results(results, procs, n: int, limit: float) -> list[tuple[str, str | None, float]]:
    """``n`` reports from the workers; fails at once, with the exit codes, if they died silently."""
    got, deadline = [], time.monotonic() + limit
    while len(got) < n:
        dead = all(not p.is_alive() for p in procs)  # before the get: all they sent is in the pipe
        try:
            got.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            if dead:
                codes = [p.exitcode for p in procs]
                raise AssertionError(f"the ranks exited without reporting: codes {codes}") from None
        if time.monotonic() > deadline:
            raise AssertionError(f"no report within {limit:g} s; so far {got}")
    return got


def test_a_rank_that_stops_taking_part_is_reported_within_comm_timeout(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    root = tmp_path / "ckpt"
    args = (2, str(tmp_path / "store"), str(root), results, done)
    procs = [ctx.Process(target=_silent_rank, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = _results(results, procs, 2, limit=240)
    finally:
        done.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(what != "setup" for what, _, _ in got), got
    for what, error, waited in got:
        assert error is not None and "gave up waiting" in error and "3 s timeout" in error, (what, error)
        assert "robustness.comm_timeout" in error
        assert waited < 60, f"{what}: raised after {waited:.0f} s, not within the 3 s comm_timeout's bound"
    assert [w for w, _, _ in got] == ["save", "load"]
    assert sorted(p.name for p in root.iterdir()) == ["good", "latest"]
