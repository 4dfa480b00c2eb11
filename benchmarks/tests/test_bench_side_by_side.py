"""side_by_side's process layout: ranks of its own for every run (the default), or (``--shared``) one set."""

from __future__ import annotations

import dataclasses

import pytest
import side_by_side
from side_by_side import Plan, run_world
from workloads import Workload


@dataclasses.dataclass
class _Answer:
    value: list


def _plan(fresh: bool | None) -> Plan:
    """A tiny plan; ``fresh=None`` leaves the layout at Plan's default."""
    w = Workload(kind="gpt2", layers=1, hidden=8, heads=1, vocab=16, seq=4, micro_batch=1, seed=0)
    layout = {} if fresh is None else {"fresh": fresh}
    return Plan(w, ("ddp", "zero-1", "zero-3"), (2,), rounds=2, warmup=1, steps=1, timeout=5.0, **layout)


@pytest.fixture
def launches(monkeypatch):
    """Record every ``launch`` of run_world instead of spawning ranks; each rank answers one row per run."""
    calls = []

    def fake_launch(target, world, args, *, timeout, process_group, name):
        calls.append((target.__name__, args, timeout, name))
        if target is side_by_side._rank_one:
            _, rnd, impl = args
            return [_Answer([{"round": rnd, "impl": impl, "rank": r}]) for r in range(world)]
        return [_Answer([{"round": 0, "impl": "all", "rank": r}]) for r in range(world)]

    monkeypatch.setattr(side_by_side, "launch", fake_launch)
    return calls


def test_shared_runs_every_round_of_every_implementation_in_one_set_of_ranks(launches):
    plan = _plan(fresh=False)
    rows = run_world(plan, 2)
    assert [c[0] for c in launches] == ["_rank_main"]
    assert launches[0][2] == plan.timeout * plan.rounds * len(plan.impls)
    assert len(rows) == 2


def test_by_default_every_run_gets_ranks_of_its_own_in_the_rotated_order(launches):
    plan = _plan(fresh=None)
    assert plan.fresh
    rows = run_world(plan, 2)
    runs = [(c[1][1], c[1][2]) for c in launches]
    assert runs == [(0, "ddp"), (0, "zero-1"), (0, "zero-3"), (1, "zero-1"), (1, "zero-3"), (1, "ddp")]
    assert all(c[0] == "_rank_one" and c[2] == plan.timeout for c in launches)
    # every rank's row of every run, in launch order
    assert [(r["round"], r["impl"], r["rank"]) for r in rows][:4] == [
        (0, "ddp", 0),
        (0, "ddp", 1),
        (0, "zero-1", 0),
        (0, "zero-1", 1),
    ]
    assert len(rows) == 2 * len(runs)


@pytest.mark.parametrize(
    "argv,shared",
    [([], False), (["--fresh"], False), (["--shared"], True), (["--worlds", "2", "--shared"], True)],
)
def test_the_command_line_chooses_the_layout(argv, shared):
    assert side_by_side.parser().parse_args(argv).shared is shared


def test_shared_and_fresh_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        side_by_side.parser().parse_args(["--shared", "--fresh"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
