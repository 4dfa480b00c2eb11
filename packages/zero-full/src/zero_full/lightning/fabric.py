"""``ZeroFabricStrategy``: Lightning Fabric with zero (stages 1-3, MiCS, ZeRO++, offload by config).

Lifecycle, as Fabric drives it (the contract of Fabric's own ``DeepSpeedStrategy``):

1. ``fabric.launch()`` -> ``setup_environment``: the process group (as Fabric's DDP) and the
   precision flag checked (``"32-true"``, ``"bf16-*"``, ``"16-*"``: the matching config section).
2. ``fabric.init_module()`` builds the model inside ``zero_full.Init`` (partitioned as created
   under stage 3).
3. ``fabric.setup(model, optimizer)`` builds the engine with the user's optimizer (its class
   and hyper-parameters, remapped onto the flat partitions) and returns the module and a
   :class:`ZeroFabricOptimizer`.
4. ``fabric.backward(loss)`` is ``engine.backward(loss)``; ``optimizer.step()`` is
   ``engine.step()`` (call it on every micro-batch: the engine steps at the accumulation
   boundary and zeroes the gradients itself). Clipping is the config's ``gradient_clipping``.
5. ``fabric.save(path, state)`` writes zero's sharded checkpoint in ``path/checkpoint`` with the
   rest of ``state`` as its client state; ``fabric.load(path, state)`` restores both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from zero_full.checkpoint import read_client_state
from zero_full.config.zero_config import ZeroConfig
from zero_full.engine import Engine, Init, initialize
from zero_full.lightning.base import ZeroStrategyBase
from zero_full.lightning.config import fill_from_trainer, load_raw
from zero_full.lightning.precision import PRECISIONS

try:
    from lightning.fabric.plugins import Precision
    from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.strategies.strategy import _Sharded
    from lightning.fabric.utilities.apply_func import apply_to_collection
    from lightning.fabric.utilities.load import _move_state_into
    from lightning.fabric.utilities.types import _PATH
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_full.lightning needs Lightning: pip install 'zero-full[lightning]'") from exc

__all__ = ["ZeroFabricOptimizer", "ZeroFabricStrategy"]

CHECKPOINT_TAG = "checkpoint"
"""Sub-directory of a ``fabric.save`` path that holds zero's sharded checkpoint."""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroFabricOptimizer:
    """The optimizer ``fabric.setup`` returns: ``step()`` is ``engine.step()``.

    ``zero_grad()`` does nothing: the engine zeroes the gradient partitions after each applied
    step, and zeroing inside an accumulation window would drop the micro-batches so far.
    ``param_groups`` are the engine's (an LR scheduler goes on :attr:`torch_optimizer`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's groups over the flat partitions (``lr`` may be changed here)."""
        return self.engine.optimizer.param_groups

    @property
    def torch_optimizer(self) -> Optimizer:
        """The torch optimizer over the flat partitions (build LR schedulers on it)."""
        return self.engine.optimizer.torch_optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """``engine.step()``: end the micro-step; at the boundary, clip, step and zero the gradients.

        Raises:
            TypeError: a ``closure`` (the engine steps once per backward).
        """
        if closure is not None:
            raise TypeError("ZeroFabricOptimizer.step() takes no closure: call fabric.backward(loss) first")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes the gradients at each applied step."""

    def state_dict(self) -> dict[str, Any]:
        """Refused: the optimizer state is sharded; save it with ``fabric.save(path, state)``."""
        raise TypeError(
            "the zero optimizer state is sharded: use fabric.save(path, {'optimizer': optimizer})"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refused: restore the optimizer with ``fabric.load(path, state)``."""
        raise TypeError(
            "the zero optimizer state is sharded: use fabric.load(path, {'optimizer': optimizer})"
        )


class ZeroFabricPrecision(Precision):
    """Fabric precision plugin of :class:`ZeroFabricStrategy`: inputs in the working dtype.

    The engine keeps fp32 masters and the bf16 / fp16 working weights (config sections filled
    from the flag); this plugin only casts floating-point inputs to match.
    """

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]
        self._dtype = _DTYPES.get(PRECISIONS[precision] or "")

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the working dtype (bf16 / fp16)."""
        if self._dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._dtype)


class ZeroFabricStrategy(ZeroStrategyBase, DDPStrategy, _Sharded):
    """Fabric strategy training with zero: ``Fabric(strategy=ZeroFabricStrategy(config=cfg))``.

    Args:
        stage: ZeRO stage (1, 2 or 3); sets ``zero_optimization.stage`` (``None``: the config's).
        config: A DeepSpeed-style dict or JSON path. ``gradient_accumulation_steps`` (default 1)
            and ``gradient_clipping`` are the config's; the ``fp16`` / ``bf16`` sections follow
            ``Fabric(precision=...)`` when left out or ``"auto"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        process_group_backend, timeout: As for Fabric's ``DDPStrategy``.

    Attributes:
        engine: The :class:`zero_full.Engine` (``None`` before ``fabric.setup``).
    """

    _optimizer: ZeroFabricOptimizer | None = None
    _NO_ENGINE_YET = "the zero engine is built by fabric.setup(model, optimizer); call it first"

    # ------------------------------------------------------------------ configuration

    def zero_config(self) -> ZeroConfig:
        """The validated config of this run: the user's, its precision sections from Fabric's flag."""
        raw = load_raw(self._raw, None)
        accumulate = raw.get("gradient_accumulation_steps", 1)
        clip = raw.get("gradient_clipping", 0.0)
        raw = fill_from_trainer(
            raw,
            accumulate=1 if accumulate == "auto" else int(accumulate),
            clip_val=0.0 if clip == "auto" else float(clip),
            precision_section=PRECISIONS[str(self.precision.precision)],
        )
        return ZeroConfig.model_validate(raw)

    def setup_environment(self) -> None:
        """Check and replace the precision plugin, then set up the process group (as DDP).

        Raises:
            ValueError: a precision flag zero does not run.
        """
        flag = str(self.precision.precision)
        if flag not in PRECISIONS:
            raise ValueError(
                f"Fabric(precision={flag!r}) cannot run under zero; zero runs precision "
                f"{', '.join(repr(p) for p in PRECISIONS)} (the engine keeps fp32 masters)"
            )
        if not isinstance(self.precision, ZeroFabricPrecision):
            self.precision = ZeroFabricPrecision(flag)
        super().setup_environment()

    # ------------------------------------------------------------------ model and optimizer

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: ``zero_full.Init`` under stage 3, Fabric's default otherwise."""
        if self.zero_config().stage == 3:
            return self.module_sharded_context()
        return super().module_init_context(empty_init)

    def module_sharded_context(self) -> AbstractContextManager:
        """``zero_full.Init`` with this run's config (active under stage 3 only)."""
        return Init(config=self.zero_config())

    def module_to_device(self, module: Module) -> None:
        """Nothing: ``initialize`` places the module (a partitioned parameter refuses ``.to``)."""

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[ZeroFabricOptimizer], Any]:
        """Build the engine over ``module`` with the one optimizer; return the module and its optimizer.

        Raises:
            ValueError: not exactly one optimizer, a scheduler, or a second ``fabric.setup``.
        """
        if len(optimizers) != 1 or scheduler is not None:
            raise ValueError(
                f"fabric.setup got {len(optimizers)} optimizer(s) and a scheduler={scheduler is not None}; "
                "zero trains one model with one optimizer: build an LR scheduler afterwards on "
                "optimizer.torch_optimizer, or use the config's scheduler section"
            )
        if self.engine is not None:
            raise ValueError("ZeroFabricStrategy trains one model: fabric.setup was already called")
        self.engine = initialize(module, config=self.zero_config(), optimizer=optimizers[0])
        self._optimizer = ZeroFabricOptimizer(self.engine)
        return module, [self._optimizer], None

    def setup_module(self, module: Module) -> Module:
        """A module without optimizer (inference): an engine whose SGD with rate 0 never steps."""
        module, _, _ = self.setup_module_and_optimizers(
            module, [torch.optim.SGD(module.parameters(), lr=0.0)]
        )
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refused: the optimizer is set up together with the module."""
        raise ValueError(self._err_msg_joint_setup_required())

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``engine.backward(loss)``: scaled by the loss scale and ``1 / gradient_accumulation_steps``."""
        self._require_engine().backward(tensor)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> None:
        """``engine.step()`` (``optimizer.step()`` of the optimizer ``fabric.setup`` returned)."""
        if kwargs:
            raise TypeError(f"zero's optimizer step takes no arguments, got {sorted(kwargs)}")
        self._require_engine().step()

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float | int, *a: Any, **k: Any
    ):
        """Refused: the engine clips the global norm at its step (config ``gradient_clipping``)."""
        raise ValueError(
            "fabric.clip_gradients cannot run under zero: the gradients are reduced and clipped inside "
            'engine.step(); set "gradient_clipping" in the zero config instead'
        )

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Refused: zero clips the global gradient norm only."""
        raise ValueError(
            "fabric.clip_gradients(clip_val=...) cannot run under zero: it clips the global gradient norm "
            '(config "gradient_clipping")'
        )

    # ------------------------------------------------------------------ checkpoints

    def _split_state(self, state: Mapping[str, Any]) -> tuple[bool, bool, dict[str, Any]]:
        """Whether ``state`` holds the engine's module and optimizer, and the rest of it."""
        engine = self._require_engine()
        has_module = any(v is engine.module for v in state.values())
        has_optimizer = any(v is self._optimizer for v in state.values())
        if not has_module:
            raise ValueError(
                "zero checkpoints hold the model: pass the module fabric.setup returned in the state, "
                "e.g. fabric.save(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        rest = {k: v for k, v in state.items() if v is not engine.module and v is not self._optimizer}
        return has_module, has_optimizer, rest

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write zero's sharded checkpoint to ``path/checkpoint``, the rest of ``state`` as its client state.

        Collective. An existing checkpoint at ``path`` is replaced.

        Raises:
            TypeError: ``storage_options`` or ``filter`` (zero writes the files itself).
        """
        if storage_options is not None or filter is not None:
            raise TypeError(
                "ZeroFabricStrategy writes checkpoints itself: storage_options / filter are not supported"
            )
        _, _, rest = self._split_state(state)
        client = self._convert_stateful_objects_in_state(rest, filter={})
        path = self.broadcast(path)
        self._require_engine().save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client, overwrite=True)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the engine from ``path/checkpoint`` and ``state``'s other entries from its client state.

        The optimizer state is read when ``state`` holds the optimizer. Returns the client
        state's entries not in ``state``. Collective.

        Raises:
            ValueError: ``state`` is not a dict holding the module ``fabric.setup`` returned.
        """
        if not isinstance(state, dict):
            raise ValueError(
                "ZeroFabricStrategy loads into a state dict holding the set-up model: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        _, has_optimizer, rest = self._split_state(state)
        path = self.broadcast(path)
        self._require_engine().load_checkpoint(
            path, tag=CHECKPOINT_TAG, strict=strict, load_optimizer_states=has_optimizer
        )
        client = read_client_state(path, CHECKPOINT_TAG)
        _move_state_into(source=client, destination=state, keys=set(rest))
        return client
