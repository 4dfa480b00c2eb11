"""The paired-steps summary: per-step ratios to DDP, their median, quartiles and interval; the rotation."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks.kit.measure import spawn_ranks, thread_minor_faults
from benchmarks.kit.report import THREAD_VARIABLES, command_env, command_line
from benchmarks.paired_steps import (
    _phased_step,
    _whole,
    median_interval,
    phases_table,
    report,
    rotation,
    summarize,
    summarize_phases,
)


def test_each_implementation_leads_in_turn():
    names = ["ddp", "zero-1", "zero-2"]
    assert [rotation(names, s)[0] for s in range(4)] == ["ddp", "zero-1", "zero-2", "ddp"]
    assert sorted(rotation(names, 2)) == sorted(names)


def test_ratios_are_taken_per_step_so_a_drift_shared_by_both_cancels():
    # the machine slows down 3x during the run; zero is 5% slower than DDP at every step
    ddp = [0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2]
    zero = [d * 1.05 for d in ddp]
    found = summarize({"ddp": ddp, "zero-2": zero}, {"ddp": ddp, "zero-2": [d * 1.02 for d in ddp]})
    assert found["zero-2"]["ratio"] == pytest.approx(1.05)
    assert found["zero-2"]["ratio_low95"] == pytest.approx(1.05)
    assert found["zero-2"]["ratio_high95"] == pytest.approx(1.05)
    assert found["zero-2"]["cpu_ratio"] == pytest.approx(1.02)
    assert found["zero-2"]["median_step_s"] == pytest.approx(0.2 * 1.05)
    assert found["ddp"]["ratio"] == 1.0


def test_quartiles_and_interval_bracket_the_median_and_an_outlier_does_not_move_it():
    ddp = [1.0] * 9
    zero = [1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 5.0]
    s = summarize({"ddp": ddp, "zero-3": zero}, {"ddp": ddp, "zero-3": zero})["zero-3"]
    assert s["ratio"] == pytest.approx(1.05)
    assert s["ratio_q1"] <= s["ratio"] <= s["ratio_q3"]
    assert 1.01 <= s["ratio_low95"] <= s["ratio"] <= s["ratio_high95"] <= 1.08


def test_unpaired_or_ddp_less_input_is_refused():
    with pytest.raises(ValueError, match="include 'ddp'"):
        summarize({"zero-1": [1.0]}, {"zero-1": [1.0]})
    with pytest.raises(ValueError, match="not paired"):
        summarize({"ddp": [1.0, 1.0], "zero-1": [1.0]}, {"ddp": [1.0, 1.0], "zero-1": [1.0]})
    with pytest.raises(ValueError, match="at least one"):
        median_interval([])


def test_the_stage3_bounds_on_the_command_line_reach_the_zero_section():
    from benchmarks.kit.impls import block_numel, zero_section
    from benchmarks.kit.workloads import workload_of
    from benchmarks.paired_steps import build_parser, options_of

    args = build_parser().parse_args(["--hidden", "96", "--prefetch-blocks", "2", "--live-blocks", "3.5"])
    w = workload_of(args)
    section = zero_section(3, w, options_of(args))
    assert section["stage3_prefetch_bucket_size"] == 2 * block_numel(w) == 2 * 12 * 96 * 96
    assert section["stage3_max_live_parameters"] == int(3.5 * block_numel(w))
    assert section["stage3_max_reuse_distance"] == 0  # still released after use
    reuse = build_parser().parse_args(["--hidden", "96", "--reuse-blocks", "4.5"])
    assert zero_section(3, w, options_of(reuse))["stage3_max_reuse_distance"] == int(4.5 * block_numel(w))
    default = zero_section(3, w, options_of(build_parser().parse_args(["--hidden", "96"])))
    assert default["stage3_prefetch_bucket_size"] == block_numel(w) // 2
    assert default["stage3_max_live_parameters"] == int(1.5 * block_numel(w))
    assert default["stage3_max_reuse_distance"] == 0


def test_reduce_max_inflight_reaches_zero_stages_1_and_2_only():
    from benchmarks.kit.impls import zero_own_section, zero_section
    from benchmarks.kit.workloads import workload_of
    from benchmarks.paired_steps import build_parser, options_of

    args = build_parser().parse_args(["--hidden", "96", "--reduce-max-inflight", "2"])
    w, options = workload_of(args), options_of(args)
    assert [zero_own_section(s, w, options).get("reduce_max_inflight") for s in (1, 2, 3)] == [2, 2, None]
    assert "reduce_max_inflight" not in zero_section(2, w, options)  # DeepSpeed's section: no such key
    default = options_of(build_parser().parse_args(["--hidden", "96"]))
    assert zero_own_section(1, w, default)["reduce_max_inflight"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--reduce-max-inflight", "0"],
            "--reduce-max-inflight and --compare-reduce-max-inflight must be >= 1",
        ),
        (
            ["--compare-reduce-max-inflight", "0"],
            "--reduce-max-inflight and --compare-reduce-max-inflight must",
        ),
        (
            ["--impls", "ddp", "zero-3", "--compare-reduce-max-inflight", "2"],
            "include one of them in --impls",
        ),
        (["--impls", "ddp", "zero-2", "--compare-per-module"], "include zero-3, without --per-module"),
        (["--impls", "ddp", "zero-3", "--per-module", "--compare-per-module"], "include zero-3, without"),
    ],
)
def test_a_comparison_or_setting_that_cannot_run_is_refused(argv, message, capsys):
    from benchmarks.paired_steps import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_compared_setting_adds_zero_1_and_2_runners_with_it():
    from benchmarks.paired_steps import parse_args, runner_specs

    args = parse_args(["--impls", "ddp", "zero-1", "zero-3", "--compare-reduce-max-inflight", "1"])
    specs = runner_specs(args)
    assert [(label, name) for label, name, _ in specs] == [
        ("ddp", "ddp"),
        ("zero-1", "zero-1"),
        ("zero-3", "zero-3"),
        ("zero-1 (inflight 1)", "zero-1"),
    ]
    assert [options.reduce_max_inflight for *_, options in specs] == [4, 4, 4, 1]
    leaves = runner_specs(parse_args(["--impls", "ddp", "zero-3", "--compare-per-module"]))
    assert [(label, name, options.leaf_blocks) for label, name, options in leaves] == [
        ("ddp", "ddp", True),
        ("zero-3", "zero-3", True),
        ("zero-3 (per module)", "zero-3", False),
    ]
    assert [label for label, *_ in runner_specs(parse_args(["--impls", "ddp", "zero-2"]))] == [
        "ddp",
        "zero-2",
    ]


@pytest.mark.parametrize("flag", ["--prefetch-blocks", "--live-blocks", "--reuse-blocks"])
def test_a_negative_stage3_bound_is_refused_with_the_flags_named(flag, capsys):
    from benchmarks.paired_steps import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args([flag, "-0.5"])
    assert exited.value.code == 2
    assert "--prefetch-blocks, --live-blocks and --reuse-blocks must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "shape",
    [
        {"hidden": 256},  # the side-by-side's GPT-2
        {"hidden": 128},  # the small one
        {"layers": 8, "hidden": 1024, "heads": 16, "seq": 64, "micro_batch": 1},  # memory.py's
        {"layers": 3, "hidden": 96, "heads": 4},
    ],
)
def test_the_threshold_is_one_blocks_granularity_and_selects_exactly_the_blocks(shape):
    """zero and DeepSpeed read the same section; the blocks are selected, never a parent (the root
    of memory.py's GPT-2, nearly all blocks, sits just above them); --per-module leaves it out."""
    from benchmarks.kit.impls import ImplOptions, block_granularity, zero_section
    from benchmarks.kit.workloads import Workload, build_model
    from benchmarks.paired_steps import build_parser, options_of
    from zero_coord import granularity_leaves

    w = Workload("gpt2", **shape)
    model = build_model(w)
    threshold = zero_section(3, w, ImplOptions())["stage3_module_granularity_threshold"]
    assert threshold == block_granularity(w)
    leaves, _ = granularity_leaves(model, threshold)
    assert leaves == [f"transformer.h.{i}" for i in range(w.layers)]
    assert granularity_leaves(model, threshold - 1)[0] != leaves  # exactly the block's, not above
    per_module = options_of(build_parser().parse_args(["--per-module"]))
    assert "stage3_module_granularity_threshold" not in zero_section(3, w, per_module)
    assert "stage3_module_granularity_threshold" not in zero_section(2, w, ImplOptions())
    assert "stage3_module_granularity_threshold" not in zero_section(3, Workload("mlp"), ImplOptions())


def test_a_run_without_ddp_is_refused_and_a_world_1_run_is_accepted(capsys):
    from benchmarks.paired_steps import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--impls", "zero-2", "zero-3"])
    assert "--impls must include ddp" in capsys.readouterr().err
    args = parse_args(["--world", "1", "--impls", "ddp", "zero-3", "--reuse-blocks", "0"])
    assert (args.world, args.impls, args.reuse_blocks) == (1, ["ddp", "zero-3"], 0.0)


def test_page_faults_per_step_are_a_median_and_a_column():
    ddp, zero = [1.0, 1.0, 1.0], [1.1, 1.1, 1.1]
    found = summarize(
        {"ddp": ddp, "zero-1": zero},
        {"ddp": ddp, "zero-1": zero},
        {"ddp": [0, 0, 5], "zero-1": [900, 10, 40]},
    )
    assert found["ddp"]["faults"] == 0 and found["zero-1"]["faults"] == 40
    env = {"world": 2, "load_average_1m": 0.5, "cpus": 2}
    table = report(found, "w", env, "cmd")
    assert "| zero-1 | 1100.0 | 1.100 |" in table and table.splitlines()[7].endswith("| 40 |")
    assert "page faults / step" in table
    assert "faults" not in summarize({"ddp": ddp}, {"ddp": ddp})["ddp"]


def test_the_trainingthread_minor_faults_are_counted_when_fresh_pages_are_touched():
    size = 64 << 20  # above glibc's largest mmap threshold: fresh pages from the kernel
    before = thread_minor_faults()
    torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
    # One fault per 4 KiB page, or per 2 MiB with transparent huge pages.
    assert thread_minor_faults() - before >= size // (2 << 20)


def test_the_allocator_and_thread_settings_a_run_had_prefix_its_command(monkeypatch):
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k in THREAD_VARIABLES]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_PROC_BIND", "true")  # not a thread count: left out
    assert command_env() == ""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000000")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert command_env() == "MALLOC_ARENA_MAX=2 MALLOC_TRIM_THRESHOLD_=1000000000 OMP_NUM_THREADS=1 "


def test_a_results_command_line_reruns_the_script_with_the_same_settings_and_arguments(monkeypatch):
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k in THREAD_VARIABLES]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr("sys.argv", ["/elsewhere/benchmarks/__main__.py", "paired_steps", "--steps", "100"])
    expected = "OMP_NUM_THREADS=1 python -m benchmarks paired_steps --steps 100"
    assert command_line("paired_steps") == expected
    assert command_line("waits", []) == "OMP_NUM_THREADS=1 python -m benchmarks waits"


def test_phase_medians_and_their_differences_from_ddp():
    steps = {
        "ddp": {
            "forward": [(0.010, 0.009, 0), (0.030, 0.020, 2), (0.020, 0.010, 1)],
            "backward": [(0.050, 0.040, 0)] * 3,
            "step": [(0.005, 0.005, 0)] * 3,
        },
        "zero-1": {
            "forward": [(0.012, 0.011, 4)] * 3,
            "backward": [(0.049, 0.045, 10)] * 3,
            "step": [(0.011, 0.006, 0), (0.009, 0.006, 0), (0.100, 0.006, 0)],
        },
    }
    found = summarize_phases(steps)
    assert found["ddp"]["forward"] == {"wall_ms": 20.0, "cpu_ms": 10.0, "faults": 1}
    assert round(found["zero-1"]["step"]["wall_ms"], 6) == 11.0  # the median: an outlier does not move it
    table = phases_table(found)
    assert "| ddp | 20.0 | 50.0 | 5.0 | 10.0 | 40.0 | 5.0 | 1/0/0 |" in table
    walls, cpus = "12.0 (-8.0) | 49.0 (-1.0) | 11.0 (+6.0)", "11.0 (+1.0) | 45.0 (+5.0) | 6.0 (+1.0)"
    assert f"| zero-1 | {walls} | {cpus} | 4/10/0 |" in table
    with pytest.raises(ValueError, match="include 'ddp'"):
        summarize_phases({"zero-1": steps["zero-1"]})
    with pytest.raises(ValueError, match="zero-1 has no timings of its step"):
        summarize_phases({"ddp": steps["ddp"], "zero-1": {**steps["zero-1"], "step": []}})


class _SleepyRunner:
    """Known phase lengths: a forward of 30 ms, a backward of 60 ms, a step of 10 ms."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def forward(self, batch: int) -> torch.Tensor:
        time.sleep(0.03)
        return torch.tensor(float(batch))

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss))
        time.sleep(0.06)

    def optimizer_step(self) -> None:
        time.sleep(0.01)


def _phases_on_rank(rank: int, args: object, store: str, results) -> None:
    runner = _SleepyRunner()
    parts = _phased_step(runner, 7)
    if rank == 0:
        results.put(
            {"walls": [p.wall_s for p in parts], "whole": _whole(parts).wall_s, "losses": runner.losses}
        )


def test_each_phase_is_timed_apart_and_the_forward_loss_reaches_the_backward():
    found = spawn_ranks(_phases_on_rank, 2, None, timeout=120, process_group=True)
    assert found["losses"] == [7.0]
    walls = found["walls"]
    assert walls[0] >= 0.03 and walls[1] >= 0.06 and walls[2] >= 0.01
    assert found["whole"] == pytest.approx(sum(walls))
