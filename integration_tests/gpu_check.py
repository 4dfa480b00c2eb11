"""The GPU check behind ``nox -s gpu``: zero on one accelerator, against references, in a few minutes.

What it runs (each section's outcome and figures land in ``gpu_check.json`` and ``gpu_check.md``):

* parity: stages 0-3, MiCS and CPU offload at world 1 (NCCL) and world 2 on the one device (NCCL
  with two ranks per device where the installed NCCL allows it, else gloo over device tensors),
  each against a single-process run of the same model on the whole batch (SGD + momentum, fp32,
  TF32 off): per-step losses within 1e-5 relative and final weights within 1e-5 of each tensor's
  largest magnitude; every stage must reduce (stage 3 gather too) on side streams (the engine's
  ``comm_streams`` a ``CommStreams`` on the device, ``NoStreams`` in the dry run);
* memory and speed: peak ``max_memory_allocated`` above the model and median step time of zero
  1/2/3 against DDP and FSDP2 on the same model at world 1;
* offload placement: the offload case's fp32 masters and gradient partitions are in pinned host
  memory (on a device; on the CPU of a dry run they stay in place), and the device memory held
  after ``initialize`` is below that of stage 2 without offload;
* watchdog: world 2, one rank 3 s late into a step's first collective with ``comm_timeout`` 30 s:
  the step completes (no abort of the communicator) and both ranks agree.

``--dry-run`` runs the same code on CPU with gloo and tiny sizes (CI runs it so that it cannot rot);
the Triton kernels are checked on the device by ``nox -s gpu`` through kernels/tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_full
from zero_full.memory.rank_memory import read_process_memory, reset_process_peak
from zero_launch import LaunchError, RankContext, launch

STEPS = 6
LR = 0.05
PARITY_CASES: dict[str, dict[str, Any]] = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2, "reduce_bucket_size": 2_000},
    "stage3": {"stage": 3, "reduce_bucket_size": 2_000, "stage3_param_persistence_threshold": 0},
    "mics": {"stage": 3, "mics_shard_size": 1, "stage3_param_persistence_threshold": 0},
    "offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}
SPEED_IMPLS = ("ddp", "fsdp2", "zero-1", "zero-2", "zero-3")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model and batch sizes: odd widths (uneven shards), a batch divisible by 2."""

    width: int
    depth: int
    batch: int
    speed_width: int
    speed_depth: int
    speed_steps: int


DRY = Sizes(width=37, depth=3, batch=4, speed_width=64, speed_depth=2, speed_steps=3)
FULL = Sizes(width=1021, depth=6, batch=32, speed_width=4096, speed_depth=8, speed_steps=20)


def build_model(width: int, depth: int) -> nn.Module:
    """A seeded stack of Linear + GELU layers with a LayerNorm (the same on every rank)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.LayerNorm(width), nn.Linear(width, 7))


def global_batch(
    step: int, sizes: Sizes, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch, a pure function of the step."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sizes.batch, width, generator=g)
    y = torch.randn(sizes.batch, 7, generator=g)
    return x.to(device), y.to(device)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def device_for(dry_run: bool, local_rank: int = 0) -> torch.device:
    """The accelerator of this process (cpu in a dry run)."""
    if dry_run:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        raise SystemExit("gpu_check: no accelerator is visible to torch (use --dry-run on a CPU machine)")
    return torch.device(acc.type, local_rank % torch.accelerator.device_count())


def deterministic() -> None:
    """fp32 matmuls in fp32 (no TF32), so that the parity bounds are the CPU's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# --------------------------------------------------------------------------- parity


def reference_run(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """One process, whole batch: the numbers every case must reproduce."""
    deterministic()
    model = build_model(sizes.width, sizes.depth).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, sizes, sizes.width, device)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}}


def _init_group(ctx: RankContext, backend: str, device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend, init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world_size)


def parity_rank(ctx: RankContext, backend: str, sizes: Sizes, dry_run: bool) -> dict[str, Any]:
    """One rank of every parity case in turn: each case's losses and consolidated weights (or error)."""
    deterministic()
    device = device_for(dry_run, ctx.rank)
    _init_group(ctx, backend, device)
    try:
        return {case: _parity_case(ctx, case, sizes, device) for case in PARITY_CASES}
    finally:
        dist.destroy_process_group()


def _parity_case(ctx: RankContext, case: str, sizes: Sizes, device: torch.device) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": sizes.batch // ctx.world_size,
        "zero_optimization": PARITY_CASES[case],
    }
    model = build_model(sizes.width, sizes.depth).to(device)
    engine = zero_full.initialize(
        model, config=config, optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)
    )
    held = torch.accelerator.memory_allocated(device) if device.type != "cpu" else 0
    losses = []
    share = sizes.batch // ctx.world_size
    for step in range(STEPS):
        x, y = global_batch(step, sizes, sizes.width, device)
        rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
        loss = loss_of(engine, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / ctx.world_size)
    # numpy, not tensors: a tensor sent to the parent would travel as shared memory of this process
    params = {k: v.detach().cpu().numpy() for k, v in engine.consolidated_state_dict().items()}
    streams = type(engine.comm_streams).__name__
    return {
        "losses": losses,
        "params": params if ctx.rank == 0 else None,
        "held": held,
        "streams": streams,
        **_placement(engine),
    }


def expected_streams(case: str, dry_run: bool) -> str:
    """Every stage reduces on side streams on a GPU (stage 3 gathers there too); CPU uses none."""
    return "NoStreams" if dry_run else "CommStreams"


def _placement(engine: Any) -> dict[str, Any]:
    """Where an offloaded optimizer keeps its fp32 masters and gradient partitions (none: empty)."""
    opt = engine.optimizer
    if opt.offload is None:
        return {}
    groups = [g for g in opt.groups if g.numel]
    return {
        "master_devices": sorted({str(t.device) for g in groups for t in (g.master, g.grad)}),
        "pinned": all(t.is_pinned() for g in groups for t in (g.master, g.grad)),
        "offloaded_device_bytes": opt.offloaded_device_bytes,
    }


def check_offload_placement(rows: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    """The offload case's placement: host and pinned, less device memory than stage 2 (on a device)."""
    got = rows["offload"]
    out = {k: got.get(k) for k in ("master_devices", "pinned", "offloaded_device_bytes")}
    if dry_run:  # the CPU is the host: nothing moves, and the report says what offload keeps
        return {**out, "ok": out["offloaded_device_bytes"] > 0}
    out["held_bytes"], out["held_without_offload"] = got["held"], rows["stage2"]["held"]
    ok = out["master_devices"] == ["cpu"] and out["pinned"] and got["held"] < rows["stage2"]["held"]
    return {**out, "ok": bool(ok)}


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """Largest relative loss difference and largest weight difference over each tensor's magnitude."""
    loss_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["losses"], got["losses"]))
    weight_rel = max(
        float(abs(got["params"][k] - v).max() / max(float(abs(v).max()), 1e-12))
        for k, v in ref["params"].items()
    )
    return {"loss_rel": loss_rel, "weight_rel": weight_rel}


def world2_backend(dry_run: bool) -> str:
    """NCCL with two ranks on the one device where it works, else gloo over device tensors."""
    if dry_run:
        return "gloo"
    try:
        launch(_nccl_probe, 2, timeout=120, process_group=False, name="zero-gpu-probe")
        return "nccl"
    except LaunchError:
        return "gloo"


def _nccl_probe(ctx: RankContext) -> None:
    device = device_for(False, 0)
    _init_group(ctx, "nccl", device)
    try:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if t.item() != ctx.world_size:
            raise RuntimeError(f"nccl all_reduce gave {t.item()}")
    finally:
        dist.destroy_process_group()


def run_parity(sizes: Sizes, dry_run: bool) -> list[dict[str, Any]]:
    """Every case at world 1 and 2 against the single-process reference; one launch per world."""
    ref = reference_run(sizes, device_for(dry_run))
    rows = []
    for world, backend in ((1, "gloo" if dry_run else "nccl"), (2, world2_backend(dry_run))):
        try:
            answers = launch(
                parity_rank, world, backend, sizes, dry_run, timeout=600, process_group=False, name="zero-gpu"
            )
            results, error = answers[0].value, None
        except LaunchError as exc:
            results, error = {}, str(exc)[:2000]
        for case in PARITY_CASES:
            row: dict[str, Any] = {"case": case, "world": world, "backend": backend}
            if case in results:
                row.update(compare(ref, results[case]), streams=results[case]["streams"])
                row["ok"] = (
                    row["loss_rel"] <= 1e-5
                    and row["weight_rel"] <= 1e-5
                    and row["streams"] == expected_streams(case, dry_run)
                )
                if case == "offload":
                    row["placement"] = check_offload_placement(results, dry_run)
                    row["ok"] = row["ok"] and row["placement"]["ok"]
            else:
                row.update(ok=False, error=error)
            rows.append(row)
            print(f"parity {case} world {world} ({backend}): {row}", flush=True)
    return rows


# --------------------------------------------------------------------------- memory and speed


def _wrap(impl: str, model: nn.Module) -> tuple[Any, Any]:
    """(callable model, step function) of ``impl`` at world 1 with fp32 AdamW."""
    if impl == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, ddp_step_for(torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, ddp_step_for(opt)
    stage = int(impl.split("-")[1])
    engine = zero_full.initialize(
        model,
        config={"zero_optimization": {"stage": stage}},
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )

    def zero_step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return engine, zero_step


def ddp_step_for(opt: torch.optim.Optimizer) -> Any:
    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    """Reset the peak memory reading; return the memory in use now (the baseline of the next peak)."""
    if device.type == "cpu":
        if not reset_process_peak():
            raise RuntimeError(
                "gpu_check: the peak RSS cannot be reset on this machine (/proc/self/clear_refs)"
            )
        return read_process_memory().rss_bytes or 0
    torch.accelerator.reset_peak_memory_stats(device)
    return torch.accelerator.memory_allocated(device)


def _peak(device: torch.device) -> int:
    if device.type == "cpu":
        return read_process_memory().peak_rss_bytes
    return torch.accelerator.max_memory_allocated(device)


def speed_rank(ctx: RankContext, backend: str, sizes: Sizes, dry_run: bool) -> dict[str, Any]:
    """Each implementation in turn (world 1): median step time and step peak above what was in use."""
    device = device_for(dry_run, ctx.rank)
    _init_group(ctx, backend, device)
    try:
        return {impl: _speed_of(impl, sizes, device) for impl in SPEED_IMPLS}
    finally:
        dist.destroy_process_group()


def _speed_of(impl: str, sizes: Sizes, device: torch.device) -> dict[str, Any]:
    base = _reset_peak(device)
    model = build_model(sizes.speed_width, sizes.speed_depth).to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    run, step = _wrap(impl, model)
    times = []
    for i in range(sizes.speed_steps + 2):
        x, y = global_batch(i, sizes, sizes.speed_width, device)
        _synchronize(device)
        start = time.perf_counter()
        step(loss_of(run, x, y))
        _synchronize(device)
        if i >= 2:  # the first two steps build optimizer state and traces
            times.append(time.perf_counter() - start)
    peak = _peak(device) - base
    what = "peak RSS" if device.type == "cpu" else "max_memory_allocated"
    del run, step, model
    return {
        "step_ms": 1000 * statistics.median(times),
        "peak_bytes": peak,
        "model_bytes": model_bytes,
        "peak_of": what,
    }


def run_speed(sizes: Sizes, dry_run: bool) -> list[dict[str, Any]]:
    backend = "gloo" if dry_run else "nccl"
    try:
        results = launch(
            speed_rank, 1, backend, sizes, dry_run, timeout=600, process_group=False, name="zero-gpu"
        )
        found, error = results[0].value, None
    except LaunchError as exc:
        found, error = {}, str(exc)[:2000]
    rows = []
    for impl in SPEED_IMPLS:
        row: dict[str, Any] = {"impl": impl, "world": 1, "backend": backend}
        if impl in found:
            row.update(found[impl], ok=True)
        else:
            row.update(ok=False, error=error)
        rows.append(row)
        print(f"speed {impl}: {row}", flush=True)
    ddp = rows[0] if rows[0]["ok"] else None
    for row in rows:
        if ddp and row["ok"]:
            row["x_ddp"] = row["step_ms"] / ddp["step_ms"]
    return rows


# --------------------------------------------------------------------------- watchdog


def late_rank(ctx: RankContext, backend: str, sizes: Sizes, dry_run: bool) -> dict[str, Any]:
    """Rank 1 enters the second step 3 s late; the watchdog must wait, not abort."""
    device = device_for(dry_run, ctx.rank)
    _init_group(ctx, backend, device)
    try:
        config = {
            "train_micro_batch_size_per_gpu": sizes.batch // ctx.world_size,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "robustness": {"comm_timeout": 30.0},
        }
        engine = zero_full.initialize(
            build_model(sizes.width, sizes.depth).to(device),
            config=config,
            optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        )
        losses = []
        for step in range(3):
            if step == 1 and ctx.rank == 1:
                time.sleep(3.0)
            x, y = global_batch(step, sizes, sizes.width, device)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return {"losses": losses}
    finally:
        dist.destroy_process_group()


def run_watchdog(sizes: Sizes, dry_run: bool, backend: str) -> dict[str, Any]:
    row: dict[str, Any] = {"late_seconds": 3.0, "comm_timeout": 30.0, "backend": backend}
    try:
        answers = launch(
            late_rank, 2, backend, sizes, dry_run, timeout=300, process_group=False, name="zero-gpu"
        )
        row["ok"] = answers[0].value["losses"] == answers[1].value["losses"]
        row["losses_agree"] = row["ok"]
    except LaunchError as exc:
        row.update(ok=False, error=str(exc)[:2000])
    print(f"watchdog: {row}", flush=True)
    return row


# --------------------------------------------------------------------------- report


def environment(dry_run: bool, argv: list[str]) -> dict[str, Any]:
    acc = None if dry_run else torch.accelerator.current_accelerator()
    name = torch.cuda.get_device_name() if acc is not None and acc.type == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if acc is not None and acc.type == "cuda" else None
    return {
        "device": name,
        "torch": torch.__version__,
        "nccl": nccl,
        "python": platform.python_version(),
        "dry_run": dry_run,
        "command": " ".join(["python", "integration_tests/gpu_check.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _first_line(text: str | None) -> str:
    return (text or "").splitlines()[0][:200] if text else ""


def to_markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"# GPU check ({env['device']}, torch {env['torch']}{', dry run' if env['dry_run'] else ''})",
        "",
        f"Command: `{env['command']}` ({env['date']}).",
        "",
        "## Parity against one process (losses: max relative; weights: max over each tensor's magnitude)",
        "",
        "| case | world | backend | loss rel | weight rel | streams | ok |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["parity"]:
        if "error" in r:
            lines.append(
                f"| {r['case']} | {r['world']} | {r['backend']} | error: {_first_line(r['error'])} | | | no |"
            )
        else:
            lines.append(
                f"| {r['case']} | {r['world']} | {r['backend']} | {r['loss_rel']:.1e} | "
                f"{r['weight_rel']:.1e} | {r['streams']} | {'yes' if r['ok'] else 'no'} |"
            )
    lines += [
        "",
        "## Step time and peak memory at world 1",
        "",
        "| impl | step ms | x DDP | peak MiB | of |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in result["speed"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {_first_line(r['error'])} | | | |")
        else:
            lines.append(
                f"| {r['impl']} | {r['step_ms']:.1f} | {r.get('x_ddp', float('nan')):.2f} | "
                f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_of']} |"
            )
    w = result["watchdog"]
    lines += [
        "",
        "## Watchdog with one rank 3 s late",
        "",
        ("completed, ranks agree" if w["ok"] else "FAILED: " + w.get("error", "ranks disagree"))
        + f" ({w['backend']})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes (what CI runs)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/gpu"))
    args = parser.parse_args(argv)
    sizes = DRY if args.dry_run else FULL
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parity = run_parity(sizes, args.dry_run)
    result = {
        "environment": environment(args.dry_run, sys.argv[1:] if argv is None else argv),
        "parity": parity,
        "speed": run_speed(sizes, args.dry_run),
        "watchdog": run_watchdog(sizes, args.dry_run, parity[-1]["backend"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check_dry_run" if args.dry_run else "gpu_check"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(to_markdown(result))
    failed = [r for r in [*result["parity"], *result["speed"], result["watchdog"]] if not r["ok"]]
    print(f"gpu check: {len(failed)} failed; results in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
