"""``deepspeed.initialize``: DeepSpeed's signature and 4-tuple over :func:`zero_full.initialize`.

As DeepSpeed: the config comes from ``config`` / ``config_params`` or ``args.deepspeed_config``,
the process group is created from the launcher's environment when missing, the optimizer and LR
scheduler come from the arguments or the config's sections, and ``training_data`` becomes a
loader over a ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from zero_full.config.prepare import prepare_config
from zero_full.config.zero_config import ZeroConfig
from zero_full.deepspeed.engine import DeepSpeedEngine
from zero_full.deepspeed.launch import init_distributed
from zero_full.engine import Engine
from zero_full.wiring.optimizers import build_optimizer

__all__ = ["DEEPSPEED_GRADIENT_CLIPPING", "initialize"]

DEEPSPEED_GRADIENT_CLIPPING = 1.0
"""DeepSpeed's ``gradient_clipping`` when the config does not set it (zero's own default is 0: none)."""


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, DataLoader[Any] | None, Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``mpu`` and ``mesh_param`` are refused (no model or mesh parallelism); without a process
    group and a launcher environment the error names the command to run.
    """
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "deepspeed.initialize: mpu / mesh_param (model parallelism) are not supported by zero, "
            "which partitions over data-parallel ranks only; drop them"
        )
    source = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "deepspeed.initialize(dist_init_required=False) needs an initialised process group"
        )
    # taken as DeepSpeed takes it: "auto" values filled, keys without effect reported, not refused
    cfg, report = prepare_config(source, model, dist.get_world_size())
    cfg, spec = _optimizer(_deepspeed_defaults(cfg), optimizer, model_parameters)
    if lr_scheduler is not None and cfg.scheduler is not None:  # DeepSpeed never builds the config's then
        cfg = cfg.model_copy(update={"scheduler": None})
    engine = Engine(model, cfg, spec, config_report=report)  # builds the config's scheduler, if any
    if lr_scheduler is not None:
        engine.lr_scheduler = _client_scheduler(lr_scheduler, engine.optimizer.torch_optimizer)
    loader = _loader(training_data, cfg, collate_fn) if training_data is not None else None
    ds_engine = DeepSpeedEngine(engine, loader)
    return ds_engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config given: ``config``, ``config_params`` or ``args.deepspeed_config``."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params, from_args) if c is not None]
    if not given:
        raise ValueError(
            "deepspeed.initialize: no config; pass config=dict_or_json_path or --deepspeed_config PATH "
            "(with deepspeed.add_config_arguments(parser))"
        )
    if len(given) > 1:
        raise ValueError(
            "deepspeed.initialize: a config was given more than once (config=, config_params= and "
            "args.deepspeed_config); keep one"
        )
    return given[0]


def _deepspeed_defaults(cfg: ZeroConfig) -> ZeroConfig:
    """DeepSpeed 0.19.8's defaults where zero's differ: ``gradient_clipping`` 1.0 when not given."""
    if "gradient_clipping" in cfg.model_fields_set:
        return cfg
    return cfg.model_copy(update={"gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING})


def _optimizer(
    cfg: ZeroConfig, optimizer: Any, model_parameters: Iterable[Any] | None
) -> tuple[ZeroConfig, Any]:
    """The config and optimizer spec for :func:`zero_full.initialize`.

    Parameter groups in ``model_parameters`` (dicts with per-group options) are kept: the
    config's optimizer is built over them. A callable ``optimizer`` receives
    ``model_parameters`` (as DeepSpeed calls it), else the trainable parameters.
    """
    groups = list(model_parameters) if model_parameters is not None else None
    has_groups = groups is not None and any(isinstance(g, dict) for g in groups)
    if optimizer is None:
        if cfg.optimizer is not None and has_groups:
            section = cfg.optimizer
            return cfg.model_copy(update={"optimizer": None}), lambda _params: build_optimizer(
                section, groups
            )
        return cfg, None
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        return cfg, optimizer
    if groups is None:
        return cfg, optimizer
    return cfg, lambda _params: optimizer(groups)


def _client_scheduler(lr_scheduler: Any, torch_optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler given, or the one a callable builds over the torch optimizer."""
    is_scheduler = hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")
    return lr_scheduler if is_scheduler else lr_scheduler(torch_optimizer)


def _loader(data: Any, cfg: ZeroConfig, collate_fn: Callable[..., Any] | None) -> DataLoader[Any]:
    """DeepSpeed's training loader: micro-batches over a ``DistributedSampler`` of the ranks."""
    if isinstance(data, IterableDataset) or not isinstance(data, Dataset):
        raise ValueError(
            "deepspeed.initialize: training_data must be a map-style torch Dataset, got "
            f"{type(data).__name__}"
        )
    micro = cfg.resolve_batch(dist.get_world_size()).train_micro_batch_size_per_gpu
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    return DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn)
