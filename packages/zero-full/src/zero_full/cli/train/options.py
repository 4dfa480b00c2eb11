"""What ``zero train`` runs: its options (the command's flags) and the config they make.

:class:`TrainOptions` holds the flags; :meth:`TrainOptions.workload` is the GPT-2 they describe
(:class:`zero_full.cli.train.workloads.GPT2Workload`); :func:`build_config` the DeepSpeed-style config of
the run (``--config`` with the flags applied, else a default scaled to the small model).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zero_full.cli.train.workloads import GPT2Workload
from zero_full.config.zero_config import ZeroConfig

__all__ = ["TrainOptions", "build_config"]

_DEFAULT_LR = 3e-3
# The demo model is tiny: DeepSpeed's default persistence threshold (1e5 elements) would keep
# nearly every tensor whole, and its prefetch / live / reuse bounds would keep the whole model
# gathered. The default config scales them to the model: matrices are partitioned (biases and
# norms persist), half a block is prefetched, 1.5 blocks may be live, nothing kept for reuse.
_DEMO_PERSISTENCE_THRESHOLD = 4096
_DEMO_MODEL = GPT2Workload()
"""The demo model's default shape: the defaults of the model flags."""


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
    layers: int = _DEMO_MODEL.layers
    hidden: int = _DEMO_MODEL.hidden
    heads: int = _DEMO_MODEL.heads
    vocab: int = _DEMO_MODEL.vocab
    seq: int = _DEMO_MODEL.seq
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

    def workload(self) -> GPT2Workload:
        """The GPT-2 of the run: these sizes, weights and data seeded by ``seed``."""
        return GPT2Workload(self.layers, self.hidden, self.heads, self.vocab, self.seq, self.seed)


def build_config(opts: TrainOptions) -> dict[str, Any]:
    """The DeepSpeed-style config of the run: ``--config`` (if any) with the flags applied.

    Without a file: stage 3, AdamW (lr 3e-3), micro-batch 4, and persistence, prefetch, live
    and reuse bounds scaled to the small model. ``--stage`` and ``--micro-batch`` override the file; a file
    without an ``optimizer`` section gets the AdamW one.
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
