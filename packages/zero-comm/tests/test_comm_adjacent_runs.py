"""Adjacent runs: one add_ per run of back-to-back destinations, bit-identical to a loop of add_."""

from __future__ import annotations

import torch

from zero_comm.adjacent_runs import HostLanding, add_in_runs, adjacent_runs, in_fewer_runs
from zero_testing import RecordingStreamSource

SIZES = [0, 1, 7, 13, 1023, 0, 2]


class _Partitions:
    def __init__(self, views):
        self.views = views

    def grad_partition(self, i):
        return self.views[i]


def _flat_views(sizes, flat):
    out, offset = [], 0
    for n in sizes:
        out.append(flat[offset : offset + n])
        offset += n
    return out


def test_runs_follow_storage_and_offset():
    flat = torch.zeros(sum(SIZES))
    views = _flat_views(SIZES, flat)
    assert adjacent_runs(views) == [(0, len(SIZES))]
    assert adjacent_runs(views[::-1]) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 7)]  # empties join a run
    apart = [views[1], torch.zeros(3), views[2], views[4]]  # another storage, then a gap
    assert adjacent_runs(apart) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert adjacent_runs([]) == []


def test_the_order_with_fewer_runs_is_chosen():
    views = _flat_views(SIZES, torch.zeros(sum(SIZES)))
    items = list(range(len(SIZES)))[::-1]  # a bucket in reverse registration order
    ordered, targets, runs = in_fewer_runs(items, _Partitions(views))
    assert ordered == list(range(len(SIZES))) and runs == [(0, len(SIZES))]
    assert all(t is views[i] for t, i in zip(targets, ordered, strict=True))
    kept, _, runs = in_fewer_runs(list(range(len(SIZES))), _Partitions(views))
    assert kept == list(range(len(SIZES))) and len(runs) == 1


def test_adding_in_runs_is_bit_identical_to_one_add_per_tensor():
    g = torch.Generator().manual_seed(0)
    start = torch.randn(sum(SIZES), generator=g) * 1e3
    parts_flat = torch.randn(sum(SIZES), generator=g) * 1e-3
    parts = _flat_views(SIZES, parts_flat)
    expected = [t.clone() for t in _flat_views(SIZES, start.clone())]
    for t, p in zip(expected, parts, strict=True):
        t.add_(p)
    flat = start.clone()
    targets = _flat_views(SIZES, flat)
    # a target outside the flat buffer, and a part that is not adjacent to its neighbours
    loose = torch.randn(5, generator=g)
    targets.append(loose)
    parts.append(torch.randn(5, generator=g))
    expected.append(loose.clone().add_(parts[-1]))
    runs = adjacent_runs(targets)
    assert runs == [(0, len(SIZES)), (len(SIZES), len(SIZES) + 1)]
    with torch.profiler.profile() as prof:
        add_in_runs(targets, parts, runs)
    assert [e.name for e in prof.events() if e.name == "aten::add_"] == ["aten::add_"] * 2
    for t, e in zip(targets, expected, strict=True):
        assert torch.equal(t, e)


def test_a_mixed_order_is_sorted_by_place_in_the_storage():
    """A bucket whose order is neither the storage's nor its reverse (a bias ready before its
    weight): the partitions' order in their storage makes one run per storage."""
    views = _flat_views(SIZES, torch.zeros(sum(SIZES)))
    loose = torch.zeros(4)
    partitions = _Partitions([*views, loose])
    mixed = [3, 4, 1, 2, len(SIZES), 6, 5, 0]
    ordered, targets, runs = in_fewer_runs(mixed, partitions)
    # the flat buffer (first seen) by offset, an empty view beside its neighbour, then the loose one
    assert [i for i in ordered if SIZES[i : i + 1] != [0]] == [1, 2, 3, 4, 6, len(SIZES)]
    assert sorted(ordered) == sorted(mixed) and ordered[-1] == len(SIZES)
    assert runs == [(0, len(SIZES)), (len(SIZES), len(SIZES) + 1)]
    assert all(t is partitions.views[i] for t, i in zip(targets, ordered, strict=True))
    # the same layout in another buffer (another rank's addresses) picks the same order
    again = _Partitions([*_flat_views(SIZES, torch.zeros(sum(SIZES) + 8)[8:]), torch.zeros(4)])
    assert in_fewer_runs(mixed, again)[0] == ordered


def test_host_landing_adds_staged_parts_after_one_wait_bit_identically():
    """Staged parts are copied at once (their memory may be reused), added only after one event
    recorded on the current stream was waited on, each element once: bit-identical to add_."""
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(n, generator=g) * 1e3 for n in (3, 1, 17)]
    parts = [torch.randn(t.numel(), generator=g) * 1e-3 for t in targets]
    expected = [t.clone().add_(p) for t, p in zip(targets, parts, strict=True)]
    before = [t.clone() for t in targets]
    source = RecordingStreamSource(())
    landing = HostLanding(source, pin=False)
    for t, p in zip(targets, parts, strict=True):
        landing.stage(t, p)
        p.fill_(float("nan"))  # the copy was taken: the part's memory is free to reuse
    assert all(torch.equal(t, b) for t, b in zip(targets, before, strict=True))
    assert source.log == []
    landing.finish()
    assert source.log == [("record", "compute", "compute#1"), ("synchronize", "compute#1")]
    assert all(torch.equal(t, e) for t, e in zip(targets, expected, strict=True))
    landing.finish()  # nothing staged: no second wait
    assert len(source.log) == 2


class _StageLog(HostLanding):
    __slots__ = ("staged",)

    def __init__(self):
        super().__init__(RecordingStreamSource(()), pin=False)
        self.staged = []

    def stage(self, target, part):
        self.staged.append((target.device.type, part.device.type))


def test_host_landing_stages_only_device_parts_into_host_targets():
    landing = _StageLog()
    target = torch.zeros(4)
    landing.add(target, torch.ones(4))  # same device: added at once
    assert torch.equal(target, torch.ones(4)) and landing.staged == []
    landing.add(torch.zeros(4), torch.empty(4, device="meta"))  # a device part into host memory
    assert landing.staged == [("cpu", "meta")]
