"""Every benchmark by name: what ``python -m benchmarks <name>`` runs and what ``nox -s bench`` runs.

Standard library only: the noxfile reads this file before anything is installed. Each entry names
the benchmark (its module is ``benchmarks.<name>``, with ``build_parser()`` and ``main(argv)``), a
line saying what it measures, whether it needs DeepSpeed kept on the CPU (``DS_ACCELERATOR=cpu``),
and the runs ``nox -s bench`` makes of it (argument lists; ``--out`` and, where ``docs``, ``--docs``
are added).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

__all__ = ["BENCHMARKS", "Benchmark", "NoxRun", "find", "load"]


@dataclasses.dataclass(frozen=True)
class NoxRun:
    """One run of a benchmark in ``nox -s bench``: its arguments and whether it fills its docs block."""

    args: tuple[str, ...] = ()
    docs: bool = False


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A registered benchmark (see the module docstring)."""

    name: str
    summary: str
    deepspeed: bool = False
    runs: tuple[NoxRun, ...] = (NoxRun(),)
    session: str = "bench"
    """The nox session that runs it (``cluster-bench`` needs root)."""

    @property
    def module(self) -> str:
        """The module under ``benchmarks/`` (a benchmark is ``benchmarks/<name>.py``)."""
        return self.name

    def env(self) -> dict[str, str]:
        """The environment its runs get on top of one operator thread per rank."""
        env = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        return env | ({"DS_ACCELERATOR": "cpu"} if self.deepspeed else {})


_DOCS = (NoxRun(docs=True),)
"""The one run of a benchmark that fills its docs block."""
_EVERY = ("--impls", "ddp", "fsdp2", "zero-1", "zero-2", "zero-3")
# Each stage with its sizes left unset (sized from the model) against DeepSpeed's default sizes.
_DEFAULT_SIZES = (
    *"--micro-batch 2 --worlds 2 --rounds 4 --warmup 2 --steps 6 --shared --impls ddp fsdp2".split(),
    *(f"zero-{k}-{sizes}" for k in (1, 2, 3) for sizes in ("unset", "dsdefaults")),
    "--name",
)

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "comm",
        "zero-comm's coalesced all-gather / reduce-scatter against torch's",
        runs=(NoxRun(("--world", "2")),),
    ),
    Benchmark("quantize_kernels", "ZeRO++ quantize / dequantize kernel throughput"),
    Benchmark("quantized", "ZeRO++ quantized collectives: time, bytes across nodes, error"),
    Benchmark("mics", "MiCS against ZeRO-3: step time and bytes across the shard groups"),
    Benchmark("generate", "generation with a sharded model: tokens per second"),
    Benchmark(
        "watchdog_overhead",
        "the collective watchdog's cost per step; --check calls: the divergence check's",
        runs=(NoxRun(), NoxRun(("--check", "calls"))),
    ),
    Benchmark("offload", "CPU Adam, swap-file throughput, offloaded step time", deepspeed=True),
    Benchmark(
        "memory",
        "real memory per rank (RSS) of DDP, FSDP2, DeepSpeed and zero, fresh processes each",
        deepspeed=True,
        runs=_DOCS,
    ),
    Benchmark(
        "side_by_side",
        "step time, memory, bytes and loss of DDP, FSDP2, DeepSpeed and zero, interleaved rounds",
        deepspeed=True,
        runs=(
            NoxRun(docs=True),
            NoxRun(("--workload", "mlp", "--worlds", "2", "--rounds", "2", "--name", "side_by_side_mlp")),
            NoxRun(
                (
                    *"--workload gpt2 --layers 4 --hidden 512 --heads 8 --vocab 8192 --seq 64".split(),
                    *_DEFAULT_SIZES,
                )
                + ("side_by_side_defaults",)
            ),
            NoxRun(
                (
                    *"--workload linear --layers 5 --hidden 2048".split(),
                    *_DEFAULT_SIZES,
                    "side_by_side_defaults_linear",
                )
            ),
        ),
    ),
    Benchmark(
        "paired_steps",
        "DDP and zero stages stepped in turn in the same ranks: step time ratios to DDP",
        runs=(
            NoxRun(),
            NoxRun(("--hidden", "128", "--name", "paired_steps_small")),
            NoxRun(("--world", "1", *_EVERY, "--name", "paired_steps_world1")),
        ),
    ),
    Benchmark(
        "profile_step",
        "where one stage-3 step's time goes, against the DDP + wire floor",
        deepspeed=True,
        runs=_DOCS,
    ),
    Benchmark("waits", "a zero step's waits for its collectives, position by position"),
    Benchmark("growth", "step time and memory against model size and world size", runs=_DOCS),
    Benchmark(
        "cluster",
        "step time and inter-node bytes on a simulated two-node cluster (needs root)",
        runs=_DOCS,
        session="cluster-bench",
    ),
)


def find(name: str) -> Benchmark:
    """The benchmark registered as ``name``; ``KeyError`` naming the registered ones otherwise."""
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    raise KeyError(f"no benchmark {name!r}: choose from {', '.join(b.name for b in BENCHMARKS)}")


def load(name: str) -> ModuleType:
    """The module of benchmark ``name`` (imported now: it may import torch and zero)."""
    return importlib.import_module(f"benchmarks.{find(name).module}")
