"""Teardown: an engine alive at ``destroy_process_group()`` must not keep torch's default group.

gloo aborts the process at interpreter exit ("terminate called without an active exception",
SIGABRT, in about 1 run of 5 here with torch 2.13) when a reference to ``dist.group.WORLD``
outlives ``destroy_process_group()``. Users keep their engine (and its partitioned model) alive
to the end of their script, so nothing zero builds may hold that object: the world is ``None``
in a sharding spec, a group of its own in a ``Topology``, and ``torch._dynamo`` (whose import
after ``init_process_group`` keeps references to the default group; torch imports it when it
builds an optimizer) is imported by ``zero_optim`` before the user's ``init_process_group``.
The check is deterministic: once the group is destroyed, a weak reference to the default group
object must be dead while the engine still lives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc, sys, weakref
    import torch, torch.distributed as dist
    import zero_full

    dist.init_process_group("gloo")
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **ZERO}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    torch.manual_seed(0)
    with zero_full.Init(config=cfg):
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1))
    engine = zero_full.initialize(model, config=cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1))
    loss = engine(torch.ones(2, 5)).sum()
    engine.backward(loss)
    engine.step()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if world() is not None:
        sys.exit(f"dist.group.WORLD outlived destroy_process_group ({sys.getrefcount(world()) - 1} refs)")
    # one write: print() writes its arguments separately and the two ranks' output interleaves
    sys.stdout.write(f"engine alive, default group gone: {engine.global_steps}\\n")
    sys.stdout.flush()
    """
)


@pytest.mark.parametrize("zero", [{}, {"mics_shard_size": 2}], ids=["zero3", "mics-shard-is-world"])
def test_an_engine_alive_at_teardown_holds_no_default_group(tmp_path, zero):
    script = tmp_path / "teardown.py"
    script.write_text(f"ZERO = {zero!r}\n" + SCRIPT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    proc = subprocess.run(
        [*launch, str(script)], capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("engine alive, default group gone: 1") == 2
