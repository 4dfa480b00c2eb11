"""Demo: coalesced, reduce-scatter and hierarchical collectives on local gloo ranks.

Run ``python -m zero_comm.demo [--world 2] [--ranks-per-node N]``. It launches ``world``
processes on 127.0.0.1 (:func:`zero_launch.launch`: gloo, a file store in a temporary
directory), runs every zero-comm collective on odd-shaped tensors, compares each result with plain
``torch.distributed`` collectives, and prints rank 0's :class:`CommLedger` summary.
Exits with status 1 if any result differs (or a rank fails), 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zero_comm.coalesced import all_gather_coalesced, reduce_scatter_coalesced
from zero_comm.hierarchical import hierarchical_all_gather_coalesced
from zero_comm.ledger import CommLedger
from zero_comm.partition import partition_numel
from zero_comm.topology import Topology
from zero_comm.torch_compat import all_gather_single
from zero_launch import LaunchError, RankContext, launch

SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (7,), (131,), (1023,), (4099,), (3, 5))
_RANK_TIMEOUT_S = 120.0


def compare(
    name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], rel: float = 0.0
) -> list[str]:
    """Messages for every tensor of ``got`` that differs from ``want`` by more than ``rel``.

    ``rel == 0`` asks for bit-exact equality; otherwise ``max|g - w| <= rel * max|w|``.
    """
    if len(got) != len(want):
        return [f"{name}: {len(got)} results, expected {len(want)}"]
    problems = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"{name}[{i}]: {g.dtype}{tuple(g.shape)} vs expected {w.dtype}{tuple(w.shape)}")
        elif rel == 0.0 and not torch.equal(g, w):
            problems.append(f"{name}[{i}]: values differ from the torch reference")
        elif rel and g.numel() and (g - w).abs().max() > rel * w.abs().max():
            problems.append(f"{name}[{i}]: error {(g - w).abs().max().item():.3e} beyond rel {rel:.0e}")
    return problems


def _data(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


def _check_all_gather(dtype: torch.dtype) -> list[str]:
    world = dist.get_world_size()
    shards = [_data(i, (s[0],), dtype) for i, s in enumerate(SHAPES[:-1])]
    got = all_gather_coalesced(shards, async_op=True).wait()
    want = []
    for s in shards:
        out = torch.empty(world * s.numel(), dtype=dtype)
        all_gather_single(out, s)
        want.append(out)
    return compare(f"all_gather_coalesced {dtype}", got, want)


def _check_reduce_scatter(dtype: torch.dtype) -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    tensors = [_data(10 + i, s, dtype) for i, s in enumerate(SHAPES)]
    got = reduce_scatter_coalesced(tensors, op="avg")
    want = []
    for t in tensors:  # this rank's real elements of the average, as DeepSpeed returns them
        full = t.reshape(-1).float()
        dist.all_reduce(full)
        part = partition_numel(t.numel(), world)
        want.append((full[rank * part : (rank + 1) * part] / world).to(dtype))
    return compare(
        f"reduce_scatter_coalesced {dtype}", got, want, rel=0.0 if dtype == torch.float32 else 1e-2
    )


def _check_hierarchical(topo: Topology) -> list[str]:
    hops = topo.hierarchical_groups(topo.world_size)
    shards = [_data(20 + i, (s[0],), torch.bfloat16) for i, s in enumerate(SHAPES[:-1])]
    got = hierarchical_all_gather_coalesced(shards, hops)
    want = all_gather_coalesced(shards)
    name = f"hierarchical_all_gather_coalesced ({hops.inter_size} node(s) x {hops.intra_size})"
    return compare(name, got, want)


def run_checks(topo: Topology) -> tuple[list[str], str]:
    """Run every check on this rank; returns (mismatch messages, ledger summary)."""
    problems: list[str] = []
    with CommLedger(topo) as ledger:
        for dtype in (torch.float32, torch.bfloat16):
            problems += _check_all_gather(dtype)
        ledger.step()
        for dtype in (torch.float32, torch.bfloat16):
            problems += _check_reduce_scatter(dtype)
        ledger.step()
        problems += _check_hierarchical(topo)
    return problems, ledger.summary()


def _rank_checks(ctx: RankContext) -> tuple[list[str], str]:
    """One rank of the demo (launched with its process group): mismatches and the ledger summary."""
    return run_checks(Topology())


def _launch(world: int, ranks_per_node: int) -> dict[int, tuple[list[str], str]]:
    try:
        results = launch(
            _rank_checks, world, timeout=_RANK_TIMEOUT_S, ranks_per_node=ranks_per_node, name="zero-comm-demo"
        )
    except LaunchError as exc:
        found = {f.rank: ([f"{f.describe()}\n{f.traceback}".rstrip()], "") for f in exc.failures}
        found.update({r: res.value for r, res in exc.results.items()})
        for r in range(world):
            found.setdefault(r, ([f"rank {r} did not report (killed)"], ""))
        return found
    return {r.rank: r.value for r in results}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m zero_comm.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="number of local gloo ranks (default 2)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="simulated ranks per node (default: world)"
    )
    args = parser.parse_args(argv)
    rpn = args.ranks_per_node or args.world
    if args.world < 1 or rpn < 1 or args.world % rpn:
        parser.error(f"--ranks-per-node {rpn} must be >= 1 and divide --world {args.world}")
    start = time.perf_counter()
    found = _launch(args.world, rpn)
    problems = [p for r in sorted(found) for p in found[r][0]]
    print(found[0][1] or "(rank 0 sent no ledger summary)")
    for p in problems:
        print(f"MISMATCH {p}")
    verdict = "OK" if not problems else f"{len(problems)} mismatch(es)"
    print(f"{verdict}: world {args.world}, {rpn} rank(s) per node, {time.perf_counter() - start:.1f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
