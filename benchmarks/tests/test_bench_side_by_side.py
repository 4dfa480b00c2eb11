"""side_by_side's process layout: ranks of its own for every run (the default), or (``--shared``) one set."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import side_by_side
from benchmarks.kit.workloads import Workload
from benchmarks.side_by_side import Plan, run_world


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
    assert side_by_side.build_parser().parse_args(argv).shared is shared


def test_shared_and_fresh_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        side_by_side.build_parser().parse_args(["--shared", "--fresh"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _run(impl: str, rnd: int, rank: int, steps: list[float], cpu: float, faults: float) -> dict:
    return {
        "impl": impl,
        "round": rnd,
        "rank": rank,
        "setup_s": 1.0,
        "step_s": steps,
        "cpu_s": cpu,
        "faults_per_step": faults,
        "losses": [1.0, 1.0],
        "wchar_bytes": 0,
        "model_state_bytes": 16,
    }


def test_summary_ratios_are_per_round_and_faults_are_the_median_over_rounds_of_the_rank_mean():
    """Per round: each step's slowest rank, median over steps; the ratio to DDP of the same round,
    median over rounds; page faults: mean over ranks, median over rounds."""
    plan = dataclasses.replace(_plan(True), impls=("ddp", "zero-1"), rounds=3)
    raw = []
    ddp = [[1.0, 3.0], [2.0, 2.0], [4.0, 4.0]]  # per round, slowest rank per step: medians 2, 2, 4
    zero = [[1.5, 2.5], [3.0, 3.0], [4.0, 4.4]]  # medians 2, 3, 4.2 -> ratios 1.0, 1.5, 1.05
    for rnd in range(3):
        for rank in range(2):
            slower = 0.0 if rank == 0 else -0.5  # rank 1 is never the slowest
            raw.append(_run("ddp", rnd, rank, [t + slower for t in ddp[rnd]], 1.0, 100.0 * rank))
            raw.append(_run("zero-1", rnd, rank, [t + slower for t in zero[rnd]], 1.0, 10.0 * (rnd + 1)))
    ref = _run("single", 0, 0, [1.0], 1.0, 7.0)
    rows = {r["impl"]: r for r in side_by_side.summarize(plan, 2, 1, ref, raw)}
    assert rows["zero-1"]["round_step_ms"] == pytest.approx([2000.0, 3000.0, 4200.0])
    assert rows["zero-1"]["ratio_to_ddp"] == pytest.approx(1.05)
    assert rows["ddp"]["faults_per_step"] == pytest.approx(50.0)
    assert rows["zero-1"]["faults_per_step"] == pytest.approx(20.0)
    assert rows["single"]["faults_per_step"] == pytest.approx(7.0)
    assert "| 20 |" in side_by_side.table([rows["zero-1"]])


def test_the_report_names_the_command_with_the_allocator_settings_it_ran_under(monkeypatch):
    """glibc's MALLOC_* variables change the page faults (and so the step time) of every
    implementation: a result measured under them says so in the command it records."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4294967296")
    argv = ["--worlds", "2", "--rounds", "3"]
    plan = dataclasses.replace(_plan(True), impls=("ddp",), rounds=1)
    ref = _run("single", 0, 0, [1.0], 1.0, 0.0)
    raw = [_run("ddp", 0, rank, [1.0], 1.0, 0.0) for rank in range(2)]
    result = {
        "meta": {"date": "d", "cpus": 2, "load_average_1m": 0.0, "python": "3", "versions": {"torch": "t"}},
        "plan": {**dataclasses.asdict(plan), "workload": dataclasses.asdict(plan.workload)},
        "workload_text": "w",
        "psi": 1,
        "run_seconds": 1.0,
        "command": side_by_side.command_line("side_by_side", argv),
        "rows": side_by_side.summarize(plan, 2, 1, ref, raw),
    }
    text = side_by_side.markdown(result)
    expected = "MALLOC_TRIM_THRESHOLD_=4294967296 python -m benchmarks side_by_side --worlds 2 --rounds 3"
    assert f"Command: `{expected}`" in text
    del result["command"]  # a result written before the command was recorded
    assert "(command not recorded)" in side_by_side.markdown(result)
