"""``Init``: partition parameters while the model is being constructed."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function
from torch.utils.weak import WeakIdKeyDictionary

from zero_comm import AllGatherStrategy, ReduceScatterStrategy
from zero_params.gather_release import gather
from zero_params.partitioning import partition_with
from zero_params.spec import ShardingSpec
from zero_params.state import (
    STATE_ATTR,
    ParamStatus,
    PartitionedParameter,
    ShardedParam,
    _func_label,
    is_metadata_func,
)
from zero_params.transitions import (
    make_available,
    make_not_available,
    materialize_uninitialized,
    reshard_from_full,
)

__all__ = ["Init"]

# In-place functions (Tensor methods and torch.nn.init functions) that overwrite every
# element of their first argument without reading it: a NOT_AVAILABLE target gets an
# uninitialised local buffer instead of an all-gather.
_OVERWRITE = frozenset(
    {
        "normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_", "geometric_",
        "log_normal_", "cauchy_", "bernoulli_", "trunc_normal_", "constant_", "ones_", "zeros_",
        "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
        "orthogonal_", "sparse_",
    }
)  # fmt: skip
_NEW_FACTORIES = frozenset(
    {"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided"}
)
_LIKE_FACTORIES = frozenset(
    {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
)
_ALIAS_MAKERS = frozenset({("get", "data"), ("call", "detach")})


class Init:
    """Partition every parameter created by module constructors inside the block.

    A model larger than one rank's memory can be built: each module's parameters are
    partitioned as soon as the finished module is assigned to its parent, so at any
    moment a rank holds its shards plus the whole parameters of the modules still under
    construction::

        with zero_params.Init():
            model = GPT2LMHeadModel(config)   # every parameter is partitioned on exit

    The same seed gives bit-identical weights with and without ``Init`` (``dtype=None``), also
    for models that re-initialise weights after construction; parameters created on ``meta``
    are partitioned without ever being allocated whole. How it works: the zero-params docs page.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        remote_device: str | torch.device | None = None,
        param_persistence_threshold: int = 0,
        enabled: bool = True,
        *,
        gather_strategy: AllGatherStrategy | None = None,
        reduce_strategy: ReduceScatterStrategy | None = None,
        secondary_strategy: AllGatherStrategy | None = None,
    ) -> None:
        self.enabled = enabled
        self._options: dict[str, Any] = dict(
            group=group,
            dtype=dtype,
            remote_device=remote_device,
            persistence_threshold=param_persistence_threshold,
            gather_strategy=gather_strategy,
            reduce_strategy=reduce_strategy,
            secondary_strategy=secondary_strategy,
        )
        self.spec: ShardingSpec | None = None
        self._mode: _InitMode | None = None
        self._hooks: list[Any] = []
        self._owned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._attached: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if self._mode is not None:
            raise RuntimeError("this zero_params.Init is already active; create a new Init to nest")
        opts = dict(self._options)
        group = opts.pop("group")
        self.spec = ShardingSpec.create(group, **opts)
        self._mode = _InitMode(self)
        self._hooks = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_child),
        ]
        self._mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        mode = self._mode
        if mode is None:
            return
        try:
            mode.__exit__(exc_type, exc, tb)
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._mode = None
        with record_function("zero.params.init.finish"):
            mode.flush()
            self._finish()
        self._owned = weakref.WeakSet()
        self._attached = weakref.WeakSet()

    # -- hooks ---------------------------------------------------------------------------

    def _is_innermost(self) -> bool:
        for m in reversed(torch.overrides._get_current_function_mode_stack()):
            if isinstance(m, _InitMode):
                return m.owner is self
        return False

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or self.spec is None or not self._is_innermost():
            return
        self._owned.add(module)
        if module in self._attached and STATE_ATTR not in param.__dict__:
            partition_with(self.spec, [(name, param)])

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None or self.spec is None or self._mode is None:
            return
        self._mode.flush()
        self._attached.add(child)
        if child in self._owned:
            partition_with(self.spec, _direct_unpartitioned(child))
        _qualify_names(child, name + ".")

    def _finish(self) -> None:
        spec = self.spec
        if spec is None:
            return
        owned = list(self._owned)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for module in owned:
                partition_with(spec, _direct_unpartitioned(module))
                for p in module._parameters.values():
                    state = p.__dict__.get(STATE_ATTR) if p is not None else None
                    if isinstance(state, ShardedParam) and state.persistent:
                        reshard_from_full(p, state)  # in-place init edits, replaced .data
        for module in owned:
            if module not in self._attached:
                _qualify_names(module, "")


def _direct_unpartitioned(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None and STATE_ATTR not in p.__dict__]


def _qualify_names(module: nn.Module, prefix: str) -> None:
    for qual, p in module.named_parameters():
        state = p.__dict__.get(STATE_ATTR)
        if isinstance(state, ShardedParam):
            state.name = prefix + qual


class _InitMode(TorchFunctionMode):
    """Makes partitioned parameters behave like whole ones inside :class:`Init` (see there)."""

    def __init__(self, owner: Init) -> None:
        super().__init__()
        self.owner = owner
        self.materialized: dict[int, nn.Parameter] = {}
        self.aliases: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _resolve(self, obj: Any) -> nn.Parameter | None:
        if type(obj) is PartitionedParameter:
            return obj
        if isinstance(obj, torch.Tensor) and self.aliases and obj in self.aliases:
            return self.aliases[obj]
        return None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        found = _find(self._resolve, args, kwargs)
        if not found:
            return func(*args, **kwargs)
        label = _func_label(func)
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
        target = self._resolve(first)
        waiting = [p for p in found.values() if p._zero.status is ParamStatus.INFLIGHT]
        if waiting:
            gather(waiting, async_op=False)
        pending = {pid: p for pid, p in found.items() if p._zero.status is ParamStatus.NOT_AVAILABLE}
        if target is not None and target._zero.status is ParamStatus.NOT_AVAILABLE:
            answered, value = _metadata_answer(label, target._zero, args, kwargs)
            if answered:
                return value
            if label in _ALIAS_MAKERS:
                with torch._C.DisableTorchFunctionSubclass():
                    alias = func(*args, **kwargs)
                self.aliases[alias] = target
                return alias
            if label == ("set", "data"):
                self._assign_data(target, args[1])
                return None
        if label[0] == "call" and label[1] in _NEW_FACTORIES or (pending and is_metadata_func(func)):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*_substitute(args, self._resolve, _as_is), **kwargs)
        if label[0] == "call" and label[1] in _LIKE_FACTORIES:
            return func(*_substitute(args, self._resolve, _stand_in), **_substitute_kw(kwargs, self._resolve))
        if pending:
            overwrite = label[0] == "call" and label[1] in _OVERWRITE and target is not None
            local = target if overwrite and _count_refs(self._resolve, args, kwargs, target) == 1 else None
            self._materialize(pending, local)
        return func(*_substitute(args, self._resolve, _full_data), **_substitute_kw(kwargs, self._resolve))

    def _materialize(self, pending: dict[int, nn.Parameter], local: nn.Parameter | None) -> None:
        """Make ``pending`` whole: ``local`` with an uninitialised buffer, the others by all-gather."""
        self.flush(keep=pending.keys())
        with torch._C.DisableTorchFunction():
            to_gather = [p for pid, p in pending.items() if p is not local]
            if local is not None:
                materialize_uninitialized(local, local._zero)
            if to_gather:
                gather(to_gather, async_op=False)
        self.materialized.update(pending)

    def _assign_data(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """``param.data = value`` on a NOT_AVAILABLE parameter: the new full value (any shape)."""
        self.flush(keep=(id(param),))
        with torch._C.DisableTorchFunction():
            make_available(param, param._zero, value)
        self.materialized[id(param)] = param

    def flush(self, keep: Any = ()) -> None:
        """Write materialised parameters (except ``keep`` ids) back to their shards and release them."""
        if not self.materialized:
            return
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for pid in [pid for pid in self.materialized if pid not in keep]:
                p = self.materialized.pop(pid)
                state = p._zero
                if state.status is ParamStatus.AVAILABLE and not state.persistent:
                    reshard_from_full(p, state)
                    make_not_available(p, state)


def _find(
    resolve: Callable[[Any], nn.Parameter | None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict:
    found: dict[int, nn.Parameter] = {}
    for a in _flat(args, kwargs):
        p = resolve(a)
        if p is not None:
            found[id(p)] = p
    return found


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _count_refs(resolve: Callable[[Any], Any], args: tuple[Any, ...], kwargs: dict[str, Any], p: Any) -> int:
    return sum(1 for a in _flat(args, kwargs) if resolve(a) is p)


def _metadata_answer(
    label: tuple[str, str], state: ShardedParam, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """Answer shape queries about a NOT_AVAILABLE parameter from its full shape."""
    kind, name = label
    shape = state.shape
    if (kind, name) == ("get", "shape"):
        return True, shape
    if (kind, name) == ("get", "ndim") or (kind == "call" and name in ("dim", "ndimension")):
        return True, len(shape)
    if kind != "call":
        return False, None
    if name in ("numel", "nelement"):
        return True, state.numel
    if name == "__len__":
        return True, shape[0]
    if name == "size":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return True, shape if dim is None else shape[dim]
    return False, None


def _as_is(obj: Any, p: nn.Parameter) -> Any:
    return obj


def _stand_in(obj: Any, p: nn.Parameter) -> torch.Tensor:
    state = p._zero
    if state.status is ParamStatus.AVAILABLE:
        return p.data
    return torch.empty(state.shape, dtype=state.dtype, device=state.device)


def _full_data(obj: Any, p: nn.Parameter) -> Any:
    # the parameter itself is whole now; an alias is replaced by its (whole) data
    return obj if obj is p else p.data


def _substitute(
    args: tuple[Any, ...], resolve: Callable[[Any], Any], how: Callable[[Any, nn.Parameter], Any]
) -> tuple[Any, ...]:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_sub_one(x, resolve, how) for x in a))
        else:
            out.append(_sub_one(a, resolve, how))
    return tuple(out)


def _sub_one(a: Any, resolve: Callable[[Any], Any], how: Callable[[Any, nn.Parameter], Any]) -> Any:
    p = resolve(a)
    return a if p is None else how(a, p)


def _substitute_kw(kwargs: dict[str, Any], resolve: Callable[[Any], Any]) -> dict[str, Any]:
    return {k: _sub_one(v, resolve, _full_data) for k, v in kwargs.items()}
