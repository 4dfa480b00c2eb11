"""``zero_full.Init``: partition a model while it is built, configured from a :class:`ZeroConfig`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import zero_params
from zero_comm import Topology
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.wiring.comm_dtype import comm_strategies
from zero_full.wiring.mics import build_mics_groups
from zero_full.wiring.stages import working_dtype
from zero_full.wiring.zeropp import build_zeropp

__all__ = ["ConfigLike", "Init"]

ConfigLike = ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None
"""A config as ``initialize`` and ``Init`` take it: a :class:`ZeroConfig`, a dict or a JSON path."""


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
            cfg = ZeroConfig.coerce(config)
            z = cfg.zero_optimization
            kwargs.setdefault("param_persistence_threshold", z.param_persistence_threshold)
            kwargs.setdefault("enabled", cfg.stage == 3)
            if cfg.precision is not Precision.FP32:
                kwargs.setdefault("dtype", working_dtype(cfg))  # partition in the bf16 / fp16 working dtype
            topology = None
            if kwargs["enabled"] and cfg.stage == 3 and z.mics_enabled and "group" not in kwargs:
                topology = Topology()
                mics = build_mics_groups(z, topology)
                kwargs["group"] = mics.shard
                kwargs.setdefault("gather_strategy", mics.gather_strategy)
            elif kwargs["enabled"] and cfg.stage == 3:
                comm = comm_strategies(cfg, kwargs.get("group"))  # communication_data_type
                if comm.gather is not None:
                    kwargs.setdefault("gather_strategy", comm.gather)
                if comm.reduce_scatter is not None:
                    kwargs.setdefault("reduce_strategy", comm.reduce_scatter)
            if kwargs["enabled"] and z.zeropp_enabled:
                zpp = build_zeropp(z, topology if topology is not None else Topology(), kwargs.get("group"))
                if zpp.gather is not None:
                    kwargs["gather_strategy"] = zpp.gather
                if zpp.reduce is not None:
                    kwargs["reduce_strategy"] = zpp.reduce
                kwargs.setdefault("secondary_strategy", zpp.secondary)
        super().__init__(**kwargs)
