"""The memory benchmark's pure helpers, and the Linear-stack workload it adds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.kit.impls import block_numel, zero_own_section, zero_section
from benchmarks.kit.step_memory import (
    RELEASE,
    failed_row,
    formula_bytes,
    impls_for,
    rank_figures,
    split_impl,
    summarize,
)
from benchmarks.kit.workloads import (
    Workload,
    build_model,
    enable_checkpointing,
    global_batch,
    loss_of,
    num_params,
)
from benchmarks.memory import markdown, merge_results, table

MB = 10**6


class _CountingReLU(torch.nn.ReLU):
    """ReLU counting its forward calls (a recomputation calls it again)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_split_impl_names_the_base_implementation_and_its_options():
    assert split_impl("zero-3+ckpt") == ("zero-3", dataclasses.replace(RELEASE, checkpointing=True))
    base, options = split_impl("deepspeed-3")
    assert base == "deepspeed-3" and not options.checkpointing
    assert options.persistence_threshold == 0 and options.live_blocks == 2.0
    with pytest.raises(ValueError, match="unknown implementation 'zero-4'"):
        split_impl("zero-4")
    base, leaf = split_impl("zero-3+leaf")
    assert (base, leaf) == ("zero-3", dataclasses.replace(RELEASE, leaf_blocks=True))
    assert not RELEASE.leaf_blocks  # the other rows gather per module


def test_the_defaults_rows_give_the_stage_only_or_deepspeeds_sizes():
    w = Workload("linear", layers=3, hidden=64)
    for stage in (1, 2, 3):
        base, options = split_impl(f"zero-{stage}+defaults")
        assert base == f"zero-{stage}" and zero_own_section(stage, w, options) == {"stage": stage}
    _, ds = split_impl("zero-3+dsdefaults")
    assert zero_section(3, w, ds) == {
        "stage": 3,
        "reduce_bucket_size": 500_000_000,
        "sub_group_size": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
    }
    assert zero_section(2, w, ds)["allgather_bucket_size"] == 500_000_000


def test_the_leaf_row_runs_on_gpt2_only():
    impls = ["ddp", "zero-3", "zero-3+ckpt", "zero-3+leaf"]
    assert impls_for(impls, Workload("gpt2", hidden=64)) == impls
    assert impls_for(impls, Workload("linear", layers=3, hidden=64)) == ["ddp", "zero-3", "zero-3+ckpt"]


def test_formulas_and_the_release_policy_of_stage_3():
    psi, n = 1000, 4
    assert formula_bytes("zero-3+ckpt", psi, n) == formula_bytes("fsdp2", psi, n) == 16 * psi / n
    assert formula_bytes("deepspeed-1", psi, n) == 8 * psi + 8 * psi / n
    assert formula_bytes("zero-2", psi, n) == 4 * psi + 12 * psi / n
    assert formula_bytes("ddp", psi, n) == 16 * psi
    w = Workload("linear", layers=3, hidden=64)
    assert block_numel(w) == 64 * 64 and block_numel(Workload("gpt2", hidden=64)) == 12 * 64 * 64
    section = zero_section(3, w, RELEASE)
    assert section["stage3_max_live_parameters"] == 2 * 64 * 64
    assert section["stage3_prefetch_bucket_size"] == 64 * 64
    assert section["stage3_param_persistence_threshold"] == 0 and section["stage3_max_reuse_distance"] == 0
    # transients bounded by the config at every stage: one block per bucket and per optimizer sub-group
    for stage in (1, 2, 3):
        section = zero_section(stage, w, RELEASE)
        assert section["reduce_bucket_size"] == section["allgather_bucket_size"] == 64 * 64
        assert section["sub_group_size"] == 64 * 64
    assert "sub_group_size" not in zero_section(2, w)  # the side-by-side keeps DeepSpeed's default
    # overlap_comm: the side-by-side overlaps at stages 2 and 3 (as DDP); memory keeps the defaults
    assert [zero_section(s, w).get("overlap_comm") for s in (1, 2, 3)] == [None, True, True]
    assert all("overlap_comm" not in zero_section(s, w, RELEASE) for s in (1, 2, 3))


def test_summarize_takes_the_largest_rank_and_step_above_the_baseline():
    ranks = [
        rank_figures(
            0, 200 * MB, 300 * MB, [{"rest": 400 * MB, "forward": 450 * MB, "peak": 500 * MB}], 90 * MB
        ),
        rank_figures(
            1,
            210 * MB,
            305 * MB,
            [
                {"rest": 410 * MB, "forward": 420 * MB, "peak": 480 * MB},
                {"rest": 402 * MB, "forward": 470 * MB, "peak": 530 * MB},
            ],
            95 * MB,
        ),
    ]
    row = summarize("zero-2", "linear", 2, 10 * MB, ranks)
    assert row["rest_bytes"] == 105 * MB  # rank 1, first step: 410 - 305
    assert row["forward_bytes"] == 68 * MB  # rank 1, second step: 470 - 402
    assert row["peak_added_bytes"] == 128 * MB  # rank 1, second step: 530 - 402
    assert row["step_peak_bytes"] == 225 * MB  # 530 - 305
    assert row["imports_bytes"] == 100 * MB and row["runtime_bytes"] == 210 * MB
    assert row["model_state_bytes"] == 95 * MB
    assert row["formula_bytes"] == 4 * 10 * MB + 12 * 10 * MB / 2 and row["error"] is None


def test_the_table_compares_with_ddp_and_names_a_failed_run():
    steps = [{"rest": 300 * MB, "forward": 310 * MB, "peak": 400 * MB}]
    ddp = summarize("ddp", "linear", 2, 10 * MB, [rank_figures(0, 100 * MB, 100 * MB, steps, 160 * MB)])
    half = [{"rest": 200 * MB, "forward": 210 * MB, "peak": 250 * MB}]
    zero = summarize("zero-3", "linear", 2, 10 * MB, [rank_figures(0, 100 * MB, 100 * MB, half, 80 * MB)])
    dead = failed_row("deepspeed-3", "linear", 2, 10 * MB, "benchmark rank 1 exited with code 1")
    lines = table([ddp, zero, dead]).splitlines()
    assert lines[2].split(" | ")[1:4] == ["200", "160", "1.25"]
    assert "300 (200 + 100)" in lines[2] and "| 1.00 |" in lines[2]
    assert "150 (100 + 50)" in lines[3] and "| 0.50 |" in lines[3]
    assert "failed: benchmark rank 1 exited with code 1" in lines[4]
    result = {
        "meta": {
            "date": "d",
            "cpus": 2,
            "load_average_1m": 1.0,
            "versions": {"torch": "2.13.0"},
            "python": "3",
        },
        "run_seconds": 1.0,
        "warmup": 2,
        "steps": 1,
        "workloads": {"linear": "a Linear stack"},
        "worlds": [2, 4],
        "rows": [ddp, zero, dead],
    }
    text = markdown(result)  # world 4 has no run yet: a partial report, rewritten after every run
    assert "**a Linear stack**, P = 10,000,000, world 2:" in text and "Runtime" in text
    assert "world 4" not in text


def test_the_linear_stack_has_hidden_squared_parameters_per_layer_and_checkpointing_keeps_gradients():
    w = Workload("linear", layers=3, hidden=24, micro_batch=2)
    assert num_params(build_model(w)) == 3 * 24 * 24
    batch = global_batch(w, 0, world=2)
    assert batch["x"].shape == (4, 24) and batch["y"].shape == (4, 24)
    grads, calls = [], []
    for checkpointed in (False, True):
        model = build_model(w)
        if checkpointed:
            enable_checkpointing(model)
        counter = _CountingReLU()
        for block in model.blocks:
            block[1] = counter
        loss_of(model, w, batch).backward()
        grads.append([p.grad for p in model.parameters()])
        calls.append(counter.calls)
    assert calls == [3, 6]  # checkpointed: every block's forward runs again in backward
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def _result(date, workloads, worlds, rows):
    meta = {"date": date, "cpus": 2, "load_average_1m": 1.0, "versions": {"torch": "2.13.0"}, "python": "3"}
    return {
        "meta": meta,
        "run_seconds": 10.0,
        "warmup": 2,
        "steps": 1,
        "workloads": workloads,
        "workload_shapes": {},
        "worlds": worlds,
        "impls": sorted({r["impl"] for r in rows}),
        "rows": rows,
    }


def test_merge_keeps_the_rows_not_measured_again_with_their_dates():
    steps = [{"rest": 300 * MB, "forward": 310 * MB, "peak": 400 * MB}]

    def row(impl, workload, world, date=None):
        r = summarize(impl, workload, world, 10 * MB, [rank_figures(0, 100 * MB, 100 * MB, steps, 160 * MB)])
        return r if date is None else dict(r, date=date)

    old = _result(
        "d1", {"linear": "a Linear stack"}, [2], [row("zero-2", "linear", 2), row("ddp", "linear", 2)]
    )
    new = _result(
        "d2",
        {"gpt2": "a GPT-2"},
        [4],
        [row("zero-2", "linear", 2, "d2"), row("deepspeed-1", "gpt2", 4, "d2")],
    )
    merged = merge_results(old, new)
    keys = [(r["impl"], r["workload"], r["world"], r["date"]) for r in merged["rows"]]
    # ordered by workload (the old file's first), world, then the benchmark's implementation order
    assert keys == [
        ("ddp", "linear", 2, "d1"),
        ("zero-2", "linear", 2, "d2"),
        ("deepspeed-1", "gpt2", 4, "d2"),
    ]
    assert merged["worlds"] == [2, 4] and list(merged["workloads"]) == ["linear", "gpt2"]
    assert merged["run_seconds"] == 20.0 and merged["meta"]["date"] == "d2"
    text = markdown(merged)
    unknown = "(command not recorded)"  # rows written before they carried their command
    assert (
        f"measured on d1 by {unknown}: ddp (linear, world 2); d2 by {unknown}: zero-2 (linear, world 2)"
        in text
    )


def test_the_report_names_the_command_of_each_run_its_rows_came_from():
    steps = [{"rest": 300 * MB, "forward": 310 * MB, "peak": 400 * MB}]

    def row(impl, date, command=None):
        r = summarize(impl, "linear", 2, 10 * MB, [rank_figures(0, 100 * MB, 100 * MB, steps, 160 * MB)])
        return dict(r, date=date, **({} if command is None else {"command": command}))

    one = "MALLOC_TRIM_THRESHOLD_=0 python benchmarks/memory.py --worlds 2"
    single = _result(
        "d1", {"linear": "a Linear stack"}, [2], [row("ddp", "d1", one), row("zero-2", "d1", one)]
    )
    assert f"Command: `{one}`" in markdown(single).splitlines()
    # a row of a file written before rows carried their command, merged with a new run's
    again = "python benchmarks/memory.py --impls zero-3"
    merged = merge_results(
        _result("d1", {"linear": "a Linear stack"}, [2], [row("ddp", "d1")]),
        _result("d2", {"linear": "a Linear stack"}, [2], [row("zero-3", "d2", again)]),
    )
    text = markdown(merged)
    assert f"d1 by (command not recorded): ddp (linear, world 2); d2 by `{again}`: zero-3 (linear" in text
    assert "Command: " not in text
