"""Stages 1 and 2 publish the updated parameters while the optimizer steps (``zero_optim.publish``).

Reference: the same optimizer stepped whole, then :meth:`publish_updated_shards` (every
all-gather after the step) — the parameters and optimizer state must be bit-identical, on odd
shapes, two parameter groups, bf16 working copies and world sizes 2 and 4. The pipelining
itself is shown by the order of events: the first bucket's gather is issued before the
optimizer steps the last range.
"""

from __future__ import annotations

import pytest
import torch
from optim_cases import Odd, assert_same_results, batch, flat_state, make_optimizer, step_published

from zero_optim import ReduceConfig, ReplicaPartitioning, replicated_optimizer
from zero_optim.flat import FlatGroup
from zero_optim.publish import PipelinedPublish, gather_buckets

BUCKET = 150  # full (padded) elements per all-gather: several buckets, one spanning both groups


def _train(rank, stage: int, pipelined: bool, dtype: torch.dtype, sub_group: int) -> dict:
    model = Odd(unused=True).to(dtype)
    opt, reduction = replicated_optimizer(
        model,
        make_optimizer("adamw"),
        stage,
        ReduceConfig(reduce_bucket_size=BUCKET),
        allgather_bucket_size=BUCKET,
        working_dtype=dtype,
        sub_group_size=sub_group,
    )
    world, r = rank.world_size, rank.rank
    for step in range(4):
        model(batch(step, 0, world)[4 * r : 4 * (r + 1)].to(dtype)).backward()
        reduction.at_boundary()
        step_published(opt, pipelined)
        opt.zero_grad()
    reduction.remove()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, **flat_state(opt)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "stage,dtype,sub_group",
    [(1, torch.float32, 10**9), (2, torch.float32, 37), (1, torch.bfloat16, 53), (2, torch.bfloat16, 10**9)],
)
def test_publishing_during_the_step_is_bit_identical_to_after_it(dist, world, stage, dtype, sub_group):
    """Parameters, masters and AdamW moments equal bit for bit on every rank."""
    pipelined = dist.run(world, _train, stage, True, dtype, sub_group)
    after = dist.run(world, _train, stage, False, dtype, sub_group)
    assert_same_results(pipelined, after, ("params",))
    for rank, a in enumerate(pipelined):
        for n, p in a["params"].items():
            assert torch.equal(p, pipelined[0]["params"][n]), f"rank {rank} differs from rank 0 in {n}"


def _events(rank) -> list[str]:
    """The order of stepped ranges and gather issues / waits in one step (three buckets)."""
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(
        model, make_optimizer("adamw"), 1, allgather_bucket_size=BUCKET, sub_group_size=10**9
    )
    model(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
    reduction.at_boundary()
    with torch.profiler.profile() as prof:
        opt.step()
    reduction.remove()
    wanted = ("zero.optim.sub_group_step", "zero.all_gather.issue")
    events = sorted((e for e in prof.events() if e.name in wanted), key=lambda e: e.time_range.start)
    return [e.name for e in events]


def test_the_first_gather_is_issued_before_the_optimizer_steps_the_last_range(dist):
    """Ranges and gathers interleave: one stepped range per bucket, each followed by its gather."""
    for events in dist.run(2, _events):
        steps = [i for i, e in enumerate(events) if e == "zero.optim.sub_group_step"]
        gathers = [i for i, e in enumerate(events) if e == "zero.all_gather.issue"]
        assert len(gathers) >= 3, events
        assert gathers[0] < steps[-1], events
        assert events[-1] == "zero.all_gather.issue", events


def _groups(dtype: torch.dtype) -> list[FlatGroup]:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 0, 12, 7, 30)]
    numels = [3, 0, 6, 4, 15]  # partitions of a two-rank world
    return [
        FlatGroup(params[:2], ["a", "b"], numels[:2], torch.device("cpu"), dtype),
        FlatGroup(params[2:], ["c", "d", "e"], numels[2:], torch.device("cpu"), dtype),
    ]


def test_buckets_hold_consecutive_segments_within_the_limit_and_end_where_their_last_segment_does():
    groups = _groups(torch.float32)
    buckets = gather_buckets(groups, 2, limit=16)  # full sizes 6, 0 | 12 | 8 | 30 (alone, over the limit)
    segs = [s for g in groups for s in g.segments]
    assert [[p for p, _ in b.items] for b in buckets] == [
        [segs[0].param, segs[1].param],
        [segs[2].param],
        [segs[3].param],
        [segs[4].param],
    ]
    assert [(b.group, b.end) for b in buckets] == [(0, 3), (1, 6), (1, 10), (1, 25)]
    assert buckets[1].items[0][1].data_ptr() == groups[1].working_view(segs[2]).data_ptr()
    assert PipelinedPublish(groups, buckets, lambda b: None).cuts == [[3], [6, 10, 25]]


class _LoggedHandle:
    def __init__(self, log: list[tuple[str, int]], index: int) -> None:
        self.log, self.index = log, index

    def wait(self) -> None:
        self.log.append(("wait", self.index))


def test_one_gather_is_in_flight_at_a_time_and_finish_waits_for_the_last():
    groups = _groups(torch.float32)
    buckets = gather_buckets(groups, 2, limit=16)
    log: list[tuple[str, int]] = []

    def issue(bucket):
        index = next(i for i, b in enumerate(buckets) if b is bucket)
        log.append(("issue", index))
        return _LoggedHandle(log, index)

    publish = PipelinedPublish(groups, buckets, issue)
    for gi, cuts in enumerate(publish.cuts):
        for stop in cuts:
            publish.stepped(gi, stop)
    issued_then_waited = [(what, i) for i in range(3) for what in ("issue", "wait")]
    assert log == [*issued_then_waited, ("issue", 3)]
    publish.finish()
    assert log[-1] == ("wait", 3) and len(log) == 8


def test_publish_range_in_pieces_copies_what_publish_copies():
    whole, pieces = _groups(torch.bfloat16), _groups(torch.bfloat16)
    for a, b in zip(whole, pieces, strict=True):
        values = torch.randn(a.numel)
        a.master.copy_(values)
        b.master.copy_(values)
        a.publish()
        for start, stop in ((0, 2), (2, 2), (2, a.numel - 1), (a.numel - 1, a.numel)):
            b.publish_range(start, stop)
        assert a.working is not None and b.working is not None
        assert torch.equal(a.working, b.working)
        assert torch.equal(b.working, values.to(torch.bfloat16))


def test_the_bucket_plan_is_computed_once_for_the_same_groups():
    partitioning = ReplicaPartitioning(2, 0, allgather_bucket_size=16)
    groups, others = _groups(torch.float32), _groups(torch.float32)
    first, again = partitioning.step_publisher(groups), partitioning.step_publisher(groups)
    assert first is not None and again is not None
    assert first.buckets is again.buckets  # not rebuilt every step
    assert [b.end for b in first.buckets] == [b.end for b in gather_buckets(groups, 2, 16)]
    fresh = partitioning.step_publisher(others)
    assert fresh is not None and fresh.buckets is not first.buckets
    assert fresh.buckets[0].items[0][0] is others[0].segments[0].param
    assert ReplicaPartitioning(1, 0).step_publisher(groups) is None  # stage 0: a local copy
