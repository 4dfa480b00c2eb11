"""Static gradient buckets: layout, issue order, flush of missing gradients, overlap, deferral."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_optim import BucketedReducer, BucketPlan, ReduceConfig


def _params(*numels):
    return [nn.Parameter(torch.zeros(n)) for n in numels]


class FakeReduce:
    """Records every reduce call; its handles record their waits."""

    def __init__(self, names):
        self.names = names
        self.log = []

    def __call__(self, params, async_op):
        for p in params:
            p.grad = None
        bucket = tuple(self.names[id(p)] for p in params)
        self.log.append(("issue", bucket, async_op))
        return _Handle(self.log, bucket)


class _Handle:
    def __init__(self, log, bucket):
        self.log, self.bucket = log, bucket

    def wait(self):
        self.log.append(("wait", self.bucket))


def _reducer(numels, bucket_size, overlap=False, deferred=(), max_inflight=2):
    params = _params(*numels)
    names = [f"p{i}" for i in range(len(params))]
    plan = BucketPlan(params, names, numels, bucket_size, deferred=[params[i] for i in deferred])
    fake = FakeReduce({id(p): n for p, n in zip(params, names)})
    cfg = ReduceConfig(reduce_bucket_size=bucket_size, overlap_comm=overlap, max_inflight=max_inflight)
    return params, plan, fake, BucketedReducer(plan, fake, cfg)


def _ready(reducer, *params):
    for p in params:
        p.grad = torch.ones_like(p)
        reducer.on_grad_ready(p)


def test_buckets_close_before_exceeding_the_size_and_big_params_get_their_own():
    params, plan, _, _ = _reducer([5, 3, 4, 10, 1, 0, 7], bucket_size=8)
    names = [[plan.names[id(p)] for p in b] for b in plan.buckets]
    assert names == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5", "p6"]]
    assert plan.ordered == 4 and len(plan) == 4
    assert [plan.index[id(p)] for p in params] == [0, 0, 1, 2, 3, 3, 3]


def test_deferred_parameters_get_their_own_buckets_after_the_ordered_ones():
    _, plan, _, _ = _reducer([2, 2, 2, 2, 2], bucket_size=4, deferred=(1, 3))
    names = [[plan.names[id(p)] for p in b] for b in plan.buckets]
    assert names == [["p0", "p2"], ["p4"], ["p1", "p3"]]
    assert plan.ordered == 2


def test_buckets_are_issued_in_plan_order_whatever_order_gradients_arrive_in():
    params, _, fake, red = _reducer([2, 2, 2, 2], bucket_size=4)
    _ready(red, params[3], params[2])  # bucket 1 complete, bucket 0 not: nothing yet
    assert fake.log == []
    _ready(red, params[0])
    assert fake.log == []
    _ready(red, params[1])  # bucket 0 complete: both go, in order
    assert fake.log == [("issue", ("p0", "p1"), False), ("issue", ("p2", "p3"), False)]
    red.on_backward_end()
    assert len(fake.log) == 2


def test_missing_gradients_are_flushed_at_the_end_in_order_as_zeros():
    params, _, fake, red = _reducer([2, 2, 2, 2, 2], bucket_size=4)
    _ready(red, params[0], params[1], params[4])
    assert fake.log == [("issue", ("p0", "p1"), False)]
    red.on_backward_end()  # p2 and p3 never got a gradient: their bucket still goes, before p4's
    assert [e[1] for e in fake.log] == [("p0", "p1"), ("p2", "p3"), ("p4",)]
    # the next backward starts from scratch
    fake.log.clear()
    _ready(red, *params)
    assert [e[1] for e in fake.log] == [("p0", "p1"), ("p2", "p3"), ("p4",)]


def test_deferred_buckets_wait_for_the_end_of_backward():
    params, _, fake, red = _reducer([2, 2, 2], bucket_size=2, deferred=(0,))
    _ready(red, *params)
    assert [e[1] for e in fake.log] == [("p1",), ("p2",)]
    red.on_backward_end()
    assert [e[1] for e in fake.log] == [("p1",), ("p2",), ("p0",)]


def test_overlap_keeps_at_most_max_inflight_reductions_and_waits_for_all_at_the_end():
    params, _, fake, red = _reducer([1, 1, 1, 1], bucket_size=1, overlap=True, max_inflight=2)
    _ready(red, *params)
    assert fake.log == [
        ("issue", ("p0",), True),
        ("issue", ("p1",), True),
        ("wait", ("p0",)),
        ("issue", ("p2",), True),
        ("wait", ("p1",)),
        ("issue", ("p3",), True),
    ]
    red.on_backward_end()
    assert fake.log[-2:] == [("wait", ("p2",)), ("wait", ("p3",))]


def test_a_gradient_reported_twice_in_one_backward_is_an_error():
    params, _, _, red = _reducer([2, 2], bucket_size=2)
    _ready(red, params[0])
    with pytest.raises(RuntimeError, match="'p0' was reported twice"):
        _ready(red, params[0])


def test_gradients_of_parameters_outside_the_plan_are_dropped():
    _, _, fake, red = _reducer([2], bucket_size=2)
    stranger = nn.Parameter(torch.zeros(3))
    stranger.grad = torch.ones(3)
    red.on_grad_ready(stranger)
    assert stranger.grad is None and fake.log == []


def test_reduce_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ReduceConfig(reduce_bucket_size=0)
    with pytest.raises(ValueError, match="max_inflight"):
        ReduceConfig(max_inflight=True)
