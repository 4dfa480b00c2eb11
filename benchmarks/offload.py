"""Benchmark zero-offload: CPU Adam, swap-file throughput, offloaded training step time.

Run from the repository root::

    python -m benchmarks offload

Measures, on this machine:

* CPU Adam (AdamW, lr 1e-3, weight decay 0.01) over one flat fp32 partition of 10M and 100M
  elements: elements per second of ``zero_offload.CpuAdam`` (``FUSED`` and ``EXACT`` kernels),
  of ``torch.optim.AdamW`` on the same flat tensor (its default per-tensor loop, ``foreach``
  and ``fused``) and of DeepSpeed's ``DeepSpeedCPUAdam`` (JIT-built C++; run in a subprocess
  with ``DS_ACCELERATOR=cpu``; reported as unavailable, with the reason, if it cannot be built
  or imported), and the memory-bandwidth bound: measured copy bandwidth divided by the bytes
  an Adam step touches per element (read param, grad, exp_avg, exp_avg_sq; write param,
  exp_avg, exp_avg_sq: 28 bytes).
* Swap throughput: ``zero_offload.AsyncSwapper`` writing and reading ``--swap-mib`` MiB in
  32 MiB tensors from aligned buffers, against a plain sequential ``write`` (+ ``fsync``) and
  a cold sequential ``read`` (page cache dropped with ``posix_fadvise``) of the same bytes in
  the same directory (``--swap-dir``); the ratio swapper / plain.
* Step time of a small MLP trained with the zero engine (one process, stage 3, AdamW)
  without offload, with ``offload_optimizer: cpu`` / ``nvme``, with ``offload_param: cpu`` /
  ``nvme`` and with both offloaded to nvme (``--only-steps`` re-measures just these).

Writes ``offload.json`` and ``offload.md`` into ``--out``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections.abc import Callable, Sequence

import torch

import zero_offload
from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import median_seconds
from benchmarks.kit.report import Report, command_line
from zero_offload import AdamHyper, AdamKernel, AsyncSwapper, CpuAdam, aligned_empty

ADAM_BYTES_PER_ELEMENT = 28
HYPER = AdamHyper(lr=1e-3, weight_decay=0.01, decoupled=True)


def copy_bandwidth(numel: int) -> float:
    """Memory bytes per second of ``dst.copy_(src)`` for fp32 arrays, best of 9 runs.

    A copy moves 12 bytes per element through memory: it reads ``src``, reads ``dst``'s cache
    lines for ownership and writes them back. The best run is the bound (contention only slows).
    """
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 3 * numel * 4 / min(times)


def adam_variants(numel: int) -> dict[str, Callable[[], None]]:
    """One Adam step of each in-process variant over its own flat ``numel`` partition."""
    steps: dict[str, Callable[[], None]] = {}
    for name, kernel in (
        ("zero CpuAdam (fused kernel, default)", AdamKernel.FUSED),
        ("zero CpuAdam (exact kernel)", AdamKernel.EXACT),
    ):
        p, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
        adam, count = CpuAdam(kernel), [0]

        def run(adam=adam, p=p, g=g, m=m, v=v, count=count) -> None:
            count[0] += 1
            adam.step(p, g, m, v, count[0], HYPER)

        steps[name] = run
    for name, opts in (
        ("torch.optim.AdamW (default: per-tensor loop)", {}),
        ("torch.optim.AdamW foreach=True", {"foreach": True}),
        ("torch.optim.AdamW fused=True", {"fused": True}),
    ):
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel)
        steps[name] = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **opts).step
    return steps


def round_robin(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per variant, the variants stepped in turn (all see the same machine load)."""
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


DS_SCRIPT = textwrap.dedent(
    """
    import json, statistics, sys, time, torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from zero_offload import AdamHyper, CpuAdam
    numel, repeats = int(sys.argv[1]), int(sys.argv[2])
    p = torch.nn.Parameter(torch.randn(numel)); p.grad = torch.randn(numel)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    q, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    ours, hyper = CpuAdam(), AdamHyper(lr=1e-3, weight_decay=0.01)
    opt.step(); ours.step(q, g, m, v, 1, hyper)
    ds_t, zero_t = [], []
    for i in range(repeats):  # interleaved: both see the same machine load
        t0 = time.perf_counter(); opt.step(); ds_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); ours.step(q, g, m, v, i + 2, hyper); zero_t.append(time.perf_counter() - t0)
    ds_eps, zero_eps = numel / statistics.median(ds_t), numel / statistics.median(zero_t)
    print("RESULT", json.dumps({"ds": ds_eps, "zero": zero_eps}))
    """
)


def adam_deepspeed(numel: int, repeats: int) -> tuple[float | None, float | None, str]:
    """DeepSpeedCPUAdam and zero's fused CpuAdam elements/s, interleaved in a subprocess, or a reason."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", DS_SCRIPT, str(numel), str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return None, None, "DeepSpeedCPUAdam did not finish within 30 min (JIT build or step)"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            return r["ds"], r["zero"], ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return None, None, "unavailable: " + " | ".join(tail)


def bench_adam(sizes: list[int]) -> tuple[list[dict], dict]:
    bw = copy_bandwidth(50_000_000)
    bound = bw / ADAM_BYTES_PER_ELEMENT
    rows = []
    for numel in sizes:
        repeats = 7 if numel <= 20_000_000 else 5
        ds, zero_paired, ds_note = adam_deepspeed(numel, repeats)
        seconds = round_robin(adam_variants(numel), repeats)
        variants: dict[str, float | None] = {name: numel / sec for name, sec in seconds.items()}
        variants["DeepSpeedCPUAdam 0.19.8"] = ds
        if zero_paired is not None:
            ds_note = (
                f"measured interleaved with zero fused ({zero_paired / 1e6:.0f} M el/s there): "
                f"zero fused / DeepSpeed = {zero_paired / ds:.2f}"
            )
        ref = variants["zero CpuAdam (fused kernel, default)"]
        for name, eps in variants.items():
            paired = name.startswith("DeepSpeed") and eps and zero_paired
            rows.append(
                {
                    "numel": numel,
                    "variant": name,
                    "elements_per_s": eps,
                    "zero_fused_over_this": (zero_paired / eps) if paired else (ref / eps) if eps else None,
                    "fraction_of_bandwidth_bound": (eps / bound) if eps else None,
                    "note": ds_note if name.startswith("DeepSpeed") else "",
                }
            )
            print(f"adam {numel:>11,} {name:<48} {eps or 0:>14,.0f} el/s {ds_note if eps is None else ''}")
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows, {"copy_bandwidth_bytes_per_s": bw, "bound_elements_per_s": bound}


def _evict(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path: pathlib.Path, chunks: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for c in chunks:
            view = memoryview(c.numpy())
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_read(path: pathlib.Path, chunks: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for c in chunks:
            view = memoryview(c.numpy())
            done = 0
            while done < len(view):
                n = os.readv(fd, [view[done:]])
                if n <= 0:
                    raise OSError("short read")
                done += n
    finally:
        os.close(fd)


def bench_swap(directory: pathlib.Path, mib: int, repeats: int) -> dict:
    chunk = 32 * 2**20
    count = max(1, mib * 2**20 // chunk)
    total = count * chunk
    chunks = [aligned_empty(chunk) for _ in range(count)]
    for i, c in enumerate(chunks):
        c.view(torch.float32).normal_(generator=torch.Generator().manual_seed(i))
    outs = [aligned_empty(chunk) for _ in range(count)]
    directory.mkdir(parents=True, exist_ok=True)
    plain = directory / "plain.bin"
    res: dict = {"bytes": total, "chunk_bytes": chunk}

    def pw() -> None:
        plain_write(plain, chunks)

    def pr() -> None:
        _evict(plain)
        plain_read(plain, outs)

    whole = torch.cat(chunks)
    view = memoryview(whole.numpy())
    res["crc32_bytes_per_s"] = total / median_seconds(lambda: zlib.crc32(view), repeats)
    checksum = zero_offload.payload_checksum
    res["payload_checksum_bytes_per_s"] = total / median_seconds(lambda: checksum(whole), repeats)
    res["plain_write_s"] = median_seconds(pw, repeats)
    res["plain_read_s"] = median_seconds(pr, repeats)
    plain.unlink()
    with AsyncSwapper(directory / "swap", io_threads=2) as sw:
        res["io_mode"] = sw.io_mode.value

        def sw_write() -> None:
            for h in [sw.write(f"c{i}", c) for i, c in enumerate(chunks)]:
                h.wait()

        def sw_read() -> None:
            for i in range(count):
                path = sw.path_of(f"c{i}")
                if path is not None and sw.io_mode is zero_offload.IoMode.BUFFERED:
                    _evict(path)
            for h in [sw.read(f"c{i}", o) for i, o in enumerate(outs)]:
                h.wait()

        res["swap_write_s"] = median_seconds(sw_write, repeats)
        res["swap_read_s"] = median_seconds(sw_read, repeats)
        if not all(torch.equal(a, b) for a, b in zip(chunks, outs)):
            raise RuntimeError("swap read returned other bytes than written")
    for k in ("write", "read"):
        res[f"plain_{k}_bytes_per_s"] = total / res[f"plain_{k}_s"]
        res[f"swap_{k}_bytes_per_s"] = total / res[f"swap_{k}_s"]
        res[f"{k}_ratio"] = res[f"swap_{k}_bytes_per_s"] / res[f"plain_{k}_bytes_per_s"]
    print(f"swap: {json.dumps(res)}")
    return res


STEP_SCRIPT = textwrap.dedent(
    """
    import json, os, statistics, sys, time, torch, torch.distributed as dist
    import zero_full, zero_optim
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
    zero = json.loads(sys.argv[2])
    torch.manual_seed(0)
    width, depth = 1024, 8
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    n = sum(p.numel() for p in model.parameters())
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    engine = zero_full.initialize(model, cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    x = torch.randn(16, width)
    times = []
    for i in range(7):
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        times.append(time.perf_counter() - t0)
    shards = zero_optim.offloaded_shards(engine.optimizer)
    extra = {}
    if shards is not None:
        st = shards.stats
        extra = {"swap_ins": st.swap_ins.count, "fetches": st.fetches.count, "prefetched": st.prefetched,
                 "prefetch_hits": st.prefetch_hits, "resident_shard_bytes": shards.swapper.resident_bytes}
    engine.close()
    print("RESULT", json.dumps({"step_s": statistics.median(times[2:]), "params": n, **extra}))
    dist.destroy_process_group()
    """
)


def _param_nvme(directory: pathlib.Path) -> dict:
    """Parameter swap files with a cache of 4 buffers, each one 1024 x 1024 weight shard."""
    return {
        "device": "nvme",
        "nvme_path": str(directory / "param_swap"),
        "buffer_count": 4,
        "buffer_size": 1_100_000,
    }


def _optimizer_nvme(directory: pathlib.Path) -> dict:
    """Optimizer-state swap files, pipelined, stepped in sub-groups of 2M elements."""
    return {
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(directory / "step_swap"),
            "pipeline_read": True,
            "pipeline_write": True,
        },
        "sub_group_size": 2_000_000,
    }


def bench_steps(directory: pathlib.Path) -> list[dict]:
    variants = {
        "no offload": {},
        "offload_optimizer: cpu": {"offload_optimizer": {"device": "cpu"}},
        "offload_optimizer: nvme (sub_group_size 2M, pipelined)": {
            **_optimizer_nvme(directory),
        },
        "offload_param: cpu": {"offload_param": {"device": "cpu"}},
        "offload_param: nvme (4 buffers of 1.1M, prefetch bucket 2M)": {
            "offload_param": _param_nvme(directory),
            "stage3_prefetch_bucket_size": 2_000_000,
        },
        "offload_param: nvme + offload_optimizer: nvme": {
            "offload_param": _param_nvme(directory),
            **_optimizer_nvme(directory),
            "stage3_prefetch_bucket_size": 2_000_000,
        },
    }
    rows = []
    for i, (name, zero) in enumerate(variants.items()):
        port = str(29_700 + (os.getpid() + i) % 200)
        proc = subprocess.run(
            [sys.executable, "-c", STEP_SCRIPT, port, json.dumps(zero)], capture_output=True, text=True
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"step benchmark {name!r} failed:\n{proc.stderr[-3000:]}")
        data = json.loads(line[7:])
        rows.append({"variant": name, **data})
        print(f"step {name:<58} {data['step_s'] * 1e3:8.1f} ms ({data['params']:,} params)")
    base = rows[0]["step_s"]
    for r in rows:
        r["relative_to_no_offload"] = r["step_s"] / base
    return rows


def markdown(data: dict) -> str:
    """The tables of ``offload.md``."""
    m = data["machine"]
    lines = [
        "# zero-offload benchmark",
        "",
        f"{data['date']} · torch {m['torch']} · deepspeed {m['deepspeed']} · {m['cores']} cores "
        f"available ({m['cpu_count']} logical CPUs) · torch threads {m['torch_threads']} · {m['platform']}",
        "",
        "The machine is shared with other jobs while this ran: absolute numbers are noisy; ratios "
        "measured back to back are the more meaningful figures.",
        "",
        "## CPU Adam (AdamW, one flat fp32 partition)",
        "",
        f"Copy bandwidth {data['adam_bound']['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"an Adam step touches {ADAM_BYTES_PER_ELEMENT} bytes per element, so the memory-bandwidth bound is "
        f"{data['adam_bound']['bound_elements_per_s'] / 1e6:.0f} M elements/s (copy bandwidth: best of 9 "
        "single-threaded `copy_` runs, counting 12 bytes per element: read, read-for-ownership, write). "
        "The in-process variants are stepped round-robin (median per variant), so they see the same "
        "load; DeepSpeed runs in its own process (DS_ACCELERATOR=cpu), interleaved step by step with "
        "zero's fused kernel there, and its ratio comes from that pairing. The machine is shared: "
        "a run in a quiet moment can exceed a bound measured in a busy one.",
        "",
        "| elements | variant | M elements/s | zero fused ÷ this | of bandwidth bound | note |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for r in data["adam"]:
        eps = f"{r['elements_per_s'] / 1e6:.0f}" if r["elements_per_s"] else "—"
        ratio = f"{r['zero_fused_over_this']:.2f}" if r["zero_fused_over_this"] else "—"
        frac = f"{r['fraction_of_bandwidth_bound']:.0%}" if r["fraction_of_bandwidth_bound"] else "—"
        lines.append(f"| {r['numel']:,} | {r['variant']} | {eps} | {ratio} | {frac} | {r['note']} |")
    s = data["swap"]
    lines += [
        "",
        f"## Swap throughput ({s['bytes'] / 2**20:.0f} MiB in {s['chunk_bytes'] / 2**20:.0f} MiB tensors, "
        f"{s['io_mode']} I/O, directory `{data['swap_dir']}`)",
        "",
        "| | swapper MB/s | plain sequential MB/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for k in ("write", "read"):
        lines.append(
            f"| {k} | {s[f'swap_{k}_bytes_per_s'] / 1e6:.0f} | {s[f'plain_{k}_bytes_per_s'] / 1e6:.0f} | "
            f"{s[f'{k}_ratio']:.2f} |"
        )
    lines += [
        "",
        "Plain write: `os.write` of the same chunks + `fsync`; plain read: cold (`POSIX_FADV_DONTNEED`).",
        "The swapper checksums every payload on write and verifies it on read (included above): "
        f"`payload_checksum` {s['payload_checksum_bytes_per_s'] / 1e9:.1f} GB/s vs `zlib.crc32` "
        f"{s['crc32_bytes_per_s'] / 1e9:.1f} GB/s on the same bytes.",
        "",
        "## Training step time (stage 3, one process, 8 x Linear(1024, 1024), AdamW)",
        "",
        *(
            [f"Measured {data['steps_date']} (`--only-steps`, OMP_NUM_THREADS={data.get('steps_omp')}).", ""]
            if "steps_date" in data
            else []
        ),
        "| variant | step ms | relative to no offload | parameter swap-ins (prefetched / used) |",
        "|---|---:|---:|---|",
    ]
    for r in data["steps"]:
        swaps = f"{r['swap_ins']} ({r['prefetched']} / {r['prefetch_hits']})" if "swap_ins" in r else ""
        lines.append(
            f"| {r['variant']} | {r['step_s'] * 1e3:.1f} | {r['relative_to_no_offload']:.2f} | {swaps} |"
        )
    lines += [
        "",
        "Parameter swap-ins are counted over the 7 steps (the first records the trace, so nothing is "
        "prefetched there). On this CPU-only machine `offload_param: cpu` gathers straight from the "
        'host shards (host and "device" are the same memory) and adds one copy of the updated shards '
        "per step; `nvme` adds a read of every shard per gather that misses the 4-shard host cache and "
        "one write per shard and step.",
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> BenchmarkParser:
    parser = benchmark_parser(
        "offload",
        __doc__,
        quick={"sizes": [1_000_000], "swap_mib": 64, "repeats": 1},
        swap_mib=512,
        repeats=3,
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--swap-dir", type=pathlib.Path, default=None, help="default: a temporary directory")
    parser.add_argument(
        "--only-steps",
        action="store_true",
        help="re-measure the training step times only, keeping the other sections of --out/offload.json",
    )
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    command = command_line("offload", argv)
    if args.only_steps:
        data = json.loads((args.out / "offload.json").read_text(encoding="utf-8"))
        base = pathlib.Path(tempfile.mkdtemp(prefix="zero_offload_bench_"))
        try:
            data["steps"] = bench_steps(base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        data["steps_date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        data["steps_omp"] = os.environ.get("OMP_NUM_THREADS", "unset")
        data["steps_command"] = command
        Report("offload", data, markdown(data), indent=1).write(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.swap_dir or pathlib.Path(tempfile.mkdtemp(prefix="zero_offload_bench_"))
    try:
        ds_version = importlib.metadata.version("deepspeed")  # not imported here: no side effects
    except importlib.metadata.PackageNotFoundError:
        ds_version = "not installed"
    try:
        adam, bound = bench_adam(args.sizes)
        swap = bench_swap(base / "swap_bench", args.swap_mib, args.repeats)
        steps = bench_steps(base)
    finally:
        if args.swap_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "torch": torch.__version__,
            "deepspeed": ds_version,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
        },
        "swap_dir": str(base),
        "adam_bound": bound,
        "adam": adam,
        "swap": swap,
        "steps": steps,
    }
    Report("offload", data, markdown(data), command, indent=1).write(args.out)
