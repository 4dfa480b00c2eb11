"""``zero train``: a GPT-2-style model trained with ZeRO on local gloo processes.

:func:`run_training` builds a ``transformers`` GPT-2 from a config (random weights from a
seed, nothing downloaded), spawns ``world`` local processes (``multiprocessing`` spawn,
gloo, a file store in a temporary directory, one thread each) and trains it with
:func:`zero_full.initialize` on synthetic token sequences from a seeded Markov chain, each
rank taking its slice of every global batch. The launcher draws a progress bar from rank
0's reports (loss averaged over the ranks, tokens per second) and watches every rank: a rank
that dies or raises stops the run at once (the others are killed) with an error naming it,
and every distributed wait is bounded by ``timeout``. :func:`format_summary` prints measured
model-state bytes per rank against DDP and the ZeRO formula, bytes communicated per step,
peak live parameters, the prefetch hit rate and the loss curve's ends.

``transformers`` and ``tqdm`` come with ``pip install zero-full[demo]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_comm import CommTotals, read_process_memory
from zero_coord import StepStats
from zero_full.config import Precision, ZeroConfig
from zero_full.engine import initialize
from zero_full.estimate import EstimatePrecision, estimate_model_states, format_bytes

__all__ = [
    "RankResult",
    "TrainError",
    "TrainOptions",
    "TrainSummary",
    "add_train_parser",
    "build_config",
    "build_model",
    "format_summary",
    "run_training",
    "synthetic_batch",
]

_DEFAULT_LR = 3e-3
# The demo model is tiny: DeepSpeed's default persistence threshold (1e5 elements) would keep
# nearly every tensor whole, and its prefetch / live / reuse bounds would keep the whole model
# gathered. The default config scales them to the model: matrices are partitioned (biases and
# norms persist), half a block is prefetched, 1.5 blocks may be live, nothing kept for reuse.
_DEMO_PERSISTENCE_THRESHOLD = 4096
_MARKOV_STAY = 0.8  # probability that the next token follows the chain (the rest is uniform noise)
_CRASH_EXIT_CODE = 17
_FAILURE_GRACE_S = 2.0  # after a failure, how long the other ranks may take to report theirs


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Everything ``zero train`` takes (the command's flags, same names).

    ``stage`` and ``micro_batch`` are ``None`` when not given: the ``config`` file's values
    are used, else stage 3 and 4 sequences. ``crash_rank`` is the failure-path check: that
    rank's process exits abruptly after its first step.
    """

    world: int = 2
    stage: int | None = None
    steps: int = 30
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    vocab: int = 1024
    seq: int = 64
    micro_batch: int | None = None
    ranks_per_node: int | None = None
    config: str | None = None
    seed: int = 0
    timeout: float = 300.0
    progress: bool = True
    crash_rank: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad flag."""
        for flag, value in (("--world", self.world), ("--steps", self.steps), ("--layers", self.layers)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, value in (("--hidden", self.hidden), ("--heads", self.heads), ("--seq", self.seq)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.vocab < 2:
            raise ValueError(f"--vocab must be >= 2, got {self.vocab}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        rpn = self.ranks_per_node
        if rpn is not None and (rpn < 1 or self.world % rpn):
            raise ValueError(f"--ranks-per-node {rpn} must be >= 1 and divide --world {self.world}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if self.crash_rank is not None and not (0 <= self.crash_rank < self.world and self.steps >= 2):
            raise ValueError(
                f"--crash-rank {self.crash_rank} needs a rank of --world {self.world} and --steps >= 2 "
                "(the rank dies after its first step)"
            )


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What one rank measured.

    Attributes:
        rank: The rank.
        num_params: P, parameters of the model (each tied tensor once).
        model_state_bytes: ``engine.model_state_bytes()`` after the last step.
        losses: Loss of every optimizer step, averaged over the ranks.
        comm: zero-comm collectives of every step, summed (calls, payload, ring-ideal wire bytes).
        params: Coordinator statistics summed over the micro-steps after the first optimizer
            step (the first records the trace).
        peak_live_elements: Most gathered parameter elements alive at once, over every step.
        seconds: Wall time of the training loop.
        tokens: Tokens this rank trained on.
        runtime_rss_bytes: RSS before the model was built (torch, gloo, zero_full, transformers).
        rest_rss_bytes: RSS after the last step (at rest: between steps).
        step_peak_rss_bytes: Largest per-step peak RSS (peak reset before each step; steps after
            the first, which also creates the optimizer state, unless there is only one).
        peak_resettable: Whether the peak could be reset per step (else: since the process started).
    """

    rank: int
    num_params: int
    model_state_bytes: int
    losses: tuple[float, ...]
    comm: CommTotals
    params: StepStats
    peak_live_elements: int
    seconds: float
    tokens: int
    runtime_rss_bytes: int = 0
    rest_rss_bytes: int = 0
    step_peak_rss_bytes: int = 0
    peak_resettable: bool = True


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """The outcome of :func:`run_training`: the options, the config used and every rank's result.

    ``seconds`` is the whole run's wall time; ``startup_seconds`` the part before every rank
    was ready to train (processes spawned, model built, engine initialized).
    """

    options: TrainOptions
    config: ZeroConfig
    ranks_per_node: int
    results: tuple[RankResult, ...]
    seconds: float
    startup_seconds: float = 0.0

    @property
    def losses(self) -> tuple[float, ...]:
        """Per-step loss averaged over the ranks."""
        return self.results[0].losses

    @property
    def loss_went_down(self) -> bool:
        """The final loss is finite and below the first step's."""
        return math.isfinite(self.losses[-1]) and self.losses[-1] < self.losses[0]


class TrainError(RuntimeError):
    """A rank failed, died or stopped reporting; ``rank`` is the first culprit.

    Attributes:
        rank: The rank that failed first (a rank that died is preferred over ranks whose
            collectives then failed because their peer was gone).
        traceback: That rank's traceback, or ``""`` when it died without one.
    """

    def __init__(self, message: str, rank: int, traceback_text: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback_text


# ---------------------------------------------------------------------------- config, model, data


def build_config(opts: TrainOptions) -> dict[str, Any]:
    """The DeepSpeed-style config of the run: ``--config`` (if any) with the flags applied.

    Without a file: stage 3, AdamW (lr 3e-3), micro-batch 4, and persistence, prefetch, live
    and reuse bounds scaled to the small model. ``--stage`` and ``--micro-batch`` override the file; a file
    without an ``optimizer`` section gets the AdamW one.

    Raises:
        FileNotFoundError, zero_full.config.ConfigFileError, pydantic.ValidationError: a bad
            file (validated with :meth:`ZeroConfig.from_json`, which names path and key).
        ValueError: inconsistent batch sizes for ``--world``.
    """
    if opts.config is not None:
        ZeroConfig.from_json(opts.config)  # the file's own errors, with path and key
        with open(opts.config, encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    else:
        block = 12 * opts.hidden * opts.hidden  # parameters of one transformer block, about
        data = {
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": _DEMO_PERSISTENCE_THRESHOLD,
                "stage3_prefetch_bucket_size": block // 2,
                "stage3_max_live_parameters": 3 * block // 2,
                "stage3_max_reuse_distance": 0,
            }
        }
    zero = data.setdefault("zero_optimization", {})
    if opts.stage is not None:
        zero["stage"] = opts.stage
    if opts.micro_batch is not None:
        data["train_micro_batch_size_per_gpu"] = opts.micro_batch
    elif data.get("train_batch_size") is None and data.get("train_micro_batch_size_per_gpu") is None:
        data["train_micro_batch_size_per_gpu"] = 4
    data.setdefault("optimizer", {"type": "AdamW", "params": {"lr": _DEFAULT_LR}})
    ZeroConfig.model_validate(data).resolve_batch(opts.world)
    return data


def _require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(
            "the demo model is built with the 'transformers' package, which is not installed: "
            "pip install zero-full[demo]"
        )


def build_model(opts: TrainOptions) -> nn.Module:
    """A GPT-2 language model from ``transformers`` with random weights seeded by ``opts.seed``.

    No dropout (the loss curve depends only on the seed), embeddings tied to the output head.
    """
    _require_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=opts.layers,
        n_embd=opts.hidden,
        n_head=opts.heads,
        vocab_size=opts.vocab,
        n_positions=opts.seq,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(opts.seed)
    return GPT2LMHeadModel(cfg)


def synthetic_batch(opts: TrainOptions, index: int, rows: int) -> torch.Tensor:
    """Global batch ``index``: ``rows`` token sequences of length ``opts.seq`` from a Markov chain.

    The chain (a fixed random permutation of the vocabulary, seeded by ``opts.seed``) gives
    each token's successor; with probability ``1 - 0.8`` a token is uniform noise instead. The
    loss can fall from ``ln(vocab)`` towards the chain's entropy. Same on every process.
    """
    successor = torch.randperm(opts.vocab, generator=torch.Generator().manual_seed(opts.seed))
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + 7919 * index + 1)
    noise = torch.randint(0, opts.vocab, (rows, opts.seq), generator=gen)
    follow = torch.rand(rows, opts.seq, generator=gen) < _MARKOV_STAY
    tokens = noise.clone()
    for t in range(1, opts.seq):
        tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], noise[:, t])
    return tokens


# ---------------------------------------------------------------------------- one rank


def _train_rank(rank: int, opts: TrainOptions, config: dict[str, Any], conn: Connection) -> RankResult:
    """Train on this rank; sends ``("ready", rank)`` once initialized, then ``("step", rank, step,
    loss, seconds)`` after every optimizer step."""
    world = dist.get_world_size()
    _require_transformers()
    importlib.import_module("transformers.models.gpt2.modeling_gpt2")  # the runtime, before the model
    runtime = read_process_memory().rss_bytes or 0
    model = build_model(opts)
    num_params = sum(p.numel() for p in model.parameters())
    engine = initialize(model, config)
    accumulation = engine.gradient_accumulation_steps
    micro = ZeroConfig.model_validate(config).resolve_batch(world).train_micro_batch_size_per_gpu
    zero3 = engine.config.stage == 3  # only stage 3 gathers parameters (coordinator statistics)
    conn.send(("ready", rank))  # start-up is over: the progress bar starts with the first step
    losses: list[float] = []
    comm, params, peak = CommTotals(), StepStats(), 0
    step_peaks: list[int] = []
    start = time.perf_counter()
    for step in range(opts.steps):
        if rank == opts.crash_rank and step == 1:
            os._exit(_CRASH_EXIT_CODE)  # the failure-path check: die without a word
        engine.reset_peak_memory()  # this step's peak RSS
        t0, total = time.perf_counter(), torch.zeros(())
        for m in range(accumulation):
            batch = synthetic_batch(opts, step * accumulation + m, micro * world)
            ids = batch[rank * micro : (rank + 1) * micro]
            logits = engine(input_ids=ids).logits  # next-token loss computed here, on any version
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            total += loss.detach() / accumulation
            if zero3:
                stats = engine.stats.params
                peak = max(peak, stats.max_live_elements)
                params = params + stats if step > 0 else params
        step_peaks.append(read_process_memory().peak_rss_bytes)
        comm = comm + engine.stats.comm
        dist.all_reduce(total)
        losses.append(total.item() / world)
        conn.send(("step", rank, step + 1, losses[-1], time.perf_counter() - t0))
    seconds = time.perf_counter() - start
    rest = engine.memory_report().process
    result = RankResult(
        rank=rank,
        num_params=num_params,
        model_state_bytes=engine.model_state_bytes(),
        losses=tuple(losses),
        comm=comm,
        params=params,
        peak_live_elements=peak,
        seconds=seconds,
        tokens=opts.steps * accumulation * micro * opts.seq,
        runtime_rss_bytes=runtime,
        rest_rss_bytes=rest.rss_bytes or 0,
        step_peak_rss_bytes=max(step_peaks[1:] or step_peaks),
        peak_resettable=rest.peak_resettable,
    )
    engine.close()
    return result


def _rank_main(rank: int, opts: TrainOptions, config: dict[str, Any], store: str, conn: Connection) -> None:
    """Process entry of one rank: every outcome goes back to the launcher through ``conn``."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=opts.world,
            timeout=datetime.timedelta(seconds=opts.timeout),
        )
        try:
            result = _train_rank(rank, opts, config, conn)
        finally:
            dist.destroy_process_group()
        conn.send(("done", rank, result))
    except BaseException as exc:  # every failure goes back to the launcher
        with contextlib.suppress(OSError):
            conn.send(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


# ---------------------------------------------------------------------------- the launcher


class _Progress:
    """Rank 0's progress: a tqdm bar when tqdm is importable, else one carriage-return line.

    Start-up (spawning the ranks, building the model, ``initialize``) is reported on its own
    line by :meth:`start`; the bar starts then, so its times and ETA count training steps only.
    Its one throughput figure is the average since the first step, as in the closing table.
    """

    _BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

    def __init__(self, total: int, enabled: bool, tokens_per_step: int) -> None:
        self.total = total
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        self._bar: Any = None
        self._step_seconds = 0.0
        self._started = False

    def start(self, world: int, startup_seconds: float) -> None:
        """Every rank is initialized after ``startup_seconds``: say so and start the bar."""
        if not self.enabled or self._started:
            return
        self._started = True
        print(
            f"zero train: {world} ranks started in {startup_seconds:.1f} s (processes, model, initialize)",
            file=sys.stderr,
            flush=True,
        )
        if importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc="zero train", unit="step", file=sys.stderr, bar_format=self._BAR_FORMAT
            )

    def update(self, step: int, loss: float, seconds: float) -> None:
        """Rank 0 finished optimizer step ``step`` (1-based) in ``seconds`` with this mean ``loss``."""
        if not self.enabled:
            return
        self._step_seconds += seconds
        done = self.tokens_per_step * step
        rate = done / self._step_seconds if self._step_seconds > 0 else float("inf")
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} tokens/s", refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            line = f"\rzero train: step {step}/{self.total}  loss {loss:.4f}  {rate:,.0f} tokens/s"
            print(line, end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar (or the line)."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._started:
            print(file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Watch:
    """What the launcher knows of the ranks while they run."""

    pending: dict[int, Connection]
    last_step: dict[int, int]
    results: dict[int, RankResult] = dataclasses.field(default_factory=dict)
    failures: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)  # rank, text, traceback
    died: set[int] = dataclasses.field(default_factory=set)
    ready: set[int] = dataclasses.field(default_factory=set)
    launched: float = dataclasses.field(default_factory=time.monotonic)
    startup_seconds: float = 0.0


def _receive(watch: _Watch, rank: int, procs: list[Any], progress: _Progress) -> None:
    """Handle one message (or the end of the pipe) from ``rank``."""
    conn = watch.pending[rank]
    try:
        msg = conn.recv()
    except EOFError:  # the process is gone without a final message
        del watch.pending[rank]
        procs[rank].join(1.0)
        code = procs[rank].exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
        step = watch.last_step[rank]
        watch.failures.append((rank, f"rank {rank} {how} after step {step} without reporting an error", ""))
        watch.died.add(rank)
        return
    kind = msg[0]
    if kind == "ready":
        watch.ready.add(rank)
        if len(watch.ready) == len(procs):
            watch.startup_seconds = time.monotonic() - watch.launched
            progress.start(len(procs), watch.startup_seconds)
    elif kind == "step":
        watch.last_step[rank] = msg[2]
        if rank == 0:
            progress.update(msg[2], msg[3], msg[4])
    elif kind == "done":
        watch.results[rank] = msg[2]
        del watch.pending[rank]
    else:  # "error"
        step = watch.last_step[rank]
        where = "during setup" if step == 0 else f"after step {step}"
        watch.failures.append((rank, f"rank {rank} failed {where}: {msg[2]}", msg[3]))
        del watch.pending[rank]


def _supervise(
    procs: list[Any], conns: list[Connection], opts: TrainOptions, progress: _Progress, launched: float
) -> _Watch:
    """Follow every rank until all are done, one failed (plus a short grace) or all went silent."""
    watch = _Watch(dict(enumerate(conns)), dict.fromkeys(range(opts.world), 0), launched=launched)
    last_news = time.monotonic()
    give_up: float | None = None
    # Ranks bound each distributed wait by opts.timeout; silence beyond that (plus start-up) is a hang.
    silence_limit = opts.timeout + 60.0
    while watch.pending:
        now = time.monotonic()
        limit = give_up if give_up is not None else last_news + silence_limit
        if now >= limit:
            break
        for conn in wait(list(watch.pending.values()), timeout=min(1.0, limit - now)):
            rank = next(r for r, c in watch.pending.items() if c is conn)
            _receive(watch, rank, procs, progress)
            last_news = time.monotonic()
        if watch.failures and give_up is None:
            give_up = time.monotonic() + _FAILURE_GRACE_S
    if watch.pending and not watch.failures:
        steps = ", ".join(f"rank {r}: step {watch.last_step[r]}" for r in sorted(watch.pending))
        text = f"no rank reported for {silence_limit:g} s (last reports: {steps}); killed"
        watch.failures.append((min(watch.pending), text, ""))
    return watch


def _raise_failure(watch: _Watch) -> None:
    """Raise :class:`TrainError` for the first culprit: a rank that died, else the first to fail."""
    ordered = sorted(watch.failures, key=lambda f: f[0] not in watch.died)
    rank, text, tb = ordered[0]
    same = text.split(" ", 2)[2]  # the text without "rank N "
    others = [
        f"  rank {r} failed the same way" if t.split(" ", 2)[2] == same else f"  {t}"
        for r, t, _ in ordered[1:]
    ]
    killed = sorted(watch.pending)
    if killed:
        others.append(f"  rank(s) {killed} were still running and have been stopped")
    message = f"zero train failed: {text}"
    if others:
        message += "\nthen:\n" + "\n".join(others)
    raise TrainError(message, rank, tb)


@contextlib.contextmanager
def _child_environment(ranks_per_node: int) -> Iterator[None]:
    """Environment the spawned ranks inherit: one OpenMP thread each, the simulated node size."""
    # MALLOC_MMAP_THRESHOLD_: freed blocks >= 1 MiB leave the RSS, so the memory rows follow live tensors.
    mmap = os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576")
    wanted = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(ranks_per_node), "MALLOC_MMAP_THRESHOLD_": mmap}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop(proc: Any, grace: float) -> None:
    proc.join(grace)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def run_training(opts: TrainOptions) -> TrainSummary:
    """Train the demo model on ``opts.world`` spawned local ranks.

    Returns:
        Every rank's measurements.

    Raises:
        ValueError: a bad option or an inconsistent config (before any process starts).
        ModuleNotFoundError: ``transformers`` is missing (``pip install zero-full[demo]``).
        TrainError: a rank raised (e.g. the engine refusing the config), died, or stopped
            reporting; the message names the rank, and every other rank has been stopped.
    """
    opts.validate()
    _require_transformers()
    config = build_config(opts)
    cfg = ZeroConfig.model_validate(config)
    batch = cfg.resolve_batch(opts.world)
    rpn = opts.ranks_per_node or opts.world
    progress = _Progress(opts.steps, opts.progress, batch.train_batch_size * opts.seq)
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    procs: list[Any] = []
    conns: list[Connection] = []
    finished = False
    with tempfile.TemporaryDirectory(prefix="zero-train-") as tmp:
        try:
            with _child_environment(rpn):
                for rank in range(opts.world):
                    parent, child = ctx.Pipe(duplex=False)
                    args = (rank, opts, config, os.path.join(tmp, "store"), child)
                    proc = ctx.Process(
                        target=_rank_main, args=args, name=f"zero-train-rank{rank}", daemon=True
                    )
                    proc.start()
                    child.close()
                    procs.append(proc)
                    conns.append(parent)
            watch = _supervise(procs, conns, opts, progress, start)
            finished = not watch.failures and not watch.pending
        finally:
            progress.close()
            for conn in conns:
                conn.close()
            for proc in procs:  # a finished run lets the ranks exit; otherwise they are stopped now
                _stop(proc, grace=5.0 if finished else 0.0)
    if watch.failures:
        _raise_failure(watch)
    results = tuple(watch.results[r] for r in range(opts.world))
    return TrainSummary(opts, cfg, rpn, results, time.monotonic() - start, watch.startup_seconds)


# ---------------------------------------------------------------------------- the summary


def _memory_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    psi, world, stage = summary.results[0].num_params, summary.options.world, summary.config.stage
    precision = (
        EstimatePrecision.FP32 if summary.config.precision is Precision.FP32 else EstimatePrecision.MIXED
    )
    est = {s.stage: s.total_bytes for s in estimate_model_states(psi, world, precision, (0, stage)).stages}
    rows = [
        (f"model states, rank {r.rank} (measured)", format_bytes(r.model_state_bytes))
        for r in summary.results
    ]
    worst = max(r.model_state_bytes for r in summary.results)
    rows += [_rss_row(r) for r in summary.results]
    rows += [
        ("DDP would hold (16P, fp32 AdamW)", format_bytes(16 * psi)),
        (f"ZeRO-{stage} formula ({precision.formula(stage)})", format_bytes(est[stage])),
        ("saving vs DDP (largest rank)", f"{16 * psi / worst:.2f}x less"),
    ]
    return rows


def _rss_row(r: RankResult) -> tuple[str, str]:
    """Real memory of one rank: RSS at rest and the step's peak, above the runtime's own."""
    rest, peak = r.rest_rss_bytes - r.runtime_rss_bytes, r.step_peak_rss_bytes - r.runtime_rss_bytes
    since = "" if r.peak_resettable else " (peak since start: no /proc)"
    runtime = format_bytes(r.runtime_rss_bytes)
    return (
        f"RSS at rest / step peak, rank {r.rank}",
        f"{format_bytes(rest)} / {format_bytes(peak)} above the runtime's {runtime}{since}",
    )


def _comm_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    r0, steps, world = summary.results[0], summary.options.steps, summary.options.world
    ddp = 2 * (world - 1) / world * 4 * r0.num_params  # ring all-reduce of fp32 gradients
    rows = [
        (
            "communicated per step (rank 0)",
            f"{format_bytes(r0.comm.wire_bytes / steps)} sent (ring-ideal), "
            f"{format_bytes(r0.comm.payload_bytes / steps)} payload, {r0.comm.calls / steps:.0f} collectives",
        ),
        ("DDP all-reduce would send (2(N-1)/N x 4P)", format_bytes(ddp)),
    ]
    if summary.config.stage == 3:
        peak = max(r.peak_live_elements for r in summary.results)
        params = r0.params
        hit = f"{params.prefetch_hit_rate:.1%} ({params.prefetch_hits} hits, {params.prefetch_misses} misses"
        hit += f", steps 2-{steps})" if steps > 1 else ", no step after the first)"
        rows += [
            ("peak live parameters", f"{peak:,} elements ({peak / r0.num_params:.1%} of P)"),
            ("prefetch hit rate", hit),
        ]
    else:
        rows += [("peak live parameters", f"{r0.num_params:,} (stage {summary.config.stage}: whole model)")]
    return rows


def format_summary(summary: TrainSummary) -> str:
    """The closing table ``zero train`` prints."""
    opts, r0 = summary.options, summary.results[0]
    losses = summary.losses
    tokens = sum(r.tokens for r in summary.results)
    loop = r0.seconds  # rank 0's clock, like the progress bar's figure
    nodes = opts.world // summary.ranks_per_node
    head = (
        f"zero train: ZeRO stage {summary.config.stage}, {opts.world} ranks ({nodes} node(s) x "
        f"{summary.ranks_per_node}), GPT-2 {opts.layers} layers x {opts.hidden} hidden, {opts.heads} heads, "
        f"vocab {opts.vocab}, seq {opts.seq}, P = {r0.num_params:,} parameters, "
        f"{summary.config.precision.value}"
    )
    rows = [*_memory_rows(summary), *_comm_rows(summary)]
    rows += [
        ("loss (first -> final step)", f"{losses[0]:.4f} -> {losses[-1]:.4f}"),
        ("loss went down", "yes" if summary.loss_went_down else "NO"),
        ("start-up (processes, model, initialize)", f"{summary.startup_seconds:.1f} s"),
        ("throughput", f"{tokens / loop:,.0f} tokens/s ({opts.steps} steps in {loop:.1f} s)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [head, "", f"  {'metric'.ljust(width)}  value", f"  {'-' * width}  {'-' * 5}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [
        "",
        "MB = 1e6 bytes. Model states: parameters + gradients + optimizer state, padding included.",
        "RSS: the process's resident memory above the runtime (torch, gloo, imports: the RSS before the",
        "model); at rest after the last step, step peak with the peak reset before each step",
        "(MALLOC_MMAP_THRESHOLD_=1048576 unless set: freed blocks >= 1 MiB leave the RSS).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command


def add_train_parser(sub: Any) -> None:
    """Add ``train`` to the ``zero`` subcommands (``sub`` from ``add_subparsers``)."""
    p = sub.add_parser(
        "train",
        help="the demo: train a GPT-2-style model with ZeRO on local gloo processes",
        description="Train a small GPT-2 (transformers, random init) with ZeRO on local gloo processes "
        "and print memory per rank vs DDP, bytes communicated per step and parameter traffic. "
        "Needs pip install zero-full[demo].",
    )
    ints = (
        ("--world", 2, "local ranks (default 2)"),
        ("--stage", None, "ZeRO stage (default: the config's, else 3)"),
        ("--steps", 30, "optimizer steps (default 30)"),
        ("--layers", 2, "transformer blocks (default 2)"),
        ("--hidden", 128, "hidden size (default 128)"),
        ("--heads", 4, "attention heads (default 4)"),
        ("--vocab", 1024, "vocabulary size (default 1024)"),
        ("--seq", 64, "tokens per sequence (default 64)"),
        ("--micro-batch", None, "sequences per rank per micro-step (default: the config's, else 4)"),
        ("--ranks-per-node", None, "simulated ranks per node (default: --world)"),
        ("--seed", 0, "seed of the weights and the data (default 0)"),
    )
    for flag, default, text in ints:
        p.add_argument(flag, type=int, default=default, metavar="N", help=text)
    p.add_argument("--config", metavar="DS.JSON", help="DeepSpeed-style JSON config (flags override it)")
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="limit on every distributed wait (300)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--crash-rank", type=int, default=None, help=argparse.SUPPRESS)  # failure-path check
    p.set_defaults(handler=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    opts = TrainOptions(**values, progress=not args.no_progress)
    try:
        summary = run_training(opts)
    except TrainError as exc:
        if exc.traceback:
            print(f"traceback of rank {exc.rank}:\n{exc.traceback}", file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return 1
    except (ValueError, OSError, ImportError) as exc:  # bad flags, config file, missing transformers
        print(f"zero train: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0 if math.isfinite(summary.losses[-1]) else 1
