"""``zero_full.Init``: partition a model while it is built, configured from a :class:`ZeroConfig`."""

from __future__ import annotations

from typing import Any

import zero_params
from zero_full.config.prepare import ConfigLike, validate_deepspeed
from zero_full.config.zero_config import Precision
from zero_full.wiring.dtypes import working_dtype
from zero_full.wiring.param_strategies import ParamStrategies, param_strategies

__all__ = ["ConfigLike", "Init"]


class Init(zero_params.Init):
    """``zero_params.Init`` configured from a :class:`ZeroConfig`: partition while constructing.

    ``with zero_full.Init(config=cfg): model = build()`` partitions every parameter as it
    is created, with the config's ``stage3_param_persistence_threshold`` (and in the bf16 /
    fp16 working dtype when that section is enabled); it is active only when the config
    selects stage 3 (other stages keep whole parameters). With ``mics_shard_size`` the
    parameters are partitioned over this rank's MiCS shard group (gathered hierarchically
    with ``mics_hierarchical_params_gather``); the layout is validated against the world
    here, so ``torch.distributed`` must be initialised before constructing it.

    Args:
        config: A :class:`ZeroConfig`, a DeepSpeed-style dict or a JSON path; ``None`` takes
            every ``zero_params.Init`` default.
        **kwargs: Passed to ``zero_params.Init`` (explicit values win over the config's).

    Raises:
        ValueError: an invalid MiCS layout for this world (the message names the numbers).
        RuntimeError: MiCS is configured but ``torch.distributed`` is not initialised.
    """

    def __init__(self, config: ConfigLike = None, **kwargs: Any) -> None:
        if config is not None:
            cfg, _ = validate_deepspeed(config)  # as initialize takes it ("auto" left at defaults)
            z = cfg.zero_optimization
            kwargs.setdefault("param_persistence_threshold", z.param_persistence_threshold)
            kwargs.setdefault("enabled", cfg.stage == 3)
            if cfg.precision is not Precision.FP32:
                kwargs.setdefault("dtype", working_dtype(cfg))  # partition in the bf16 / fp16 working dtype
            if kwargs["enabled"]:
                _set_strategies(
                    kwargs, param_strategies(cfg, None, kwargs.get("group"), mics="group" not in kwargs)
                )
        super().__init__(**kwargs)


def _set_strategies(kwargs: dict[str, Any], chosen: ParamStrategies) -> None:
    """Fill ``zero_params.Init``'s keyword arguments: explicit values win, except over ZeRO++'s."""
    if chosen.mics is not None:
        kwargs["group"] = chosen.mics.shard
    if chosen.base_gather is not None:
        kwargs.setdefault("gather_strategy", chosen.base_gather)
    if chosen.base_reduce is not None:
        kwargs.setdefault("reduce_strategy", chosen.base_reduce)
    if chosen.zeropp is not None:
        if chosen.zeropp.gather is not None:
            kwargs["gather_strategy"] = chosen.zeropp.gather
        if chosen.zeropp.reduce is not None:
            kwargs["reduce_strategy"] = chosen.zeropp.reduce
        kwargs.setdefault("secondary_strategy", chosen.zeropp.secondary)
