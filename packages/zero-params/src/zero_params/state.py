"""The ZeRO-3 data model: one :class:`ShardedParam` per parameter.

How a parameter finds its state
-------------------------------
A partitioned ``nn.Parameter`` keeps its identity (optimizers, tied modules and
``module._parameters`` keep pointing at the same Python object) and carries exactly one
reference to its state, the attribute ``param._zero`` holding a :class:`ShardedParam`.
Nothing else is stored on the parameter.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from zero_comm import padded_numel, partition_numel, shard_range

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from zero_comm import AllGatherStrategy, ReduceScatterStrategy

__all__ = [
    "ParamStatus",
    "PartitionedParameter",
    "PartitionedParameterError",
    "SavedTensorGuard",
    "ShardHome",
    "ShardedParam",
    "UnshardedStorage",
    "full_shape",
    "is_partitioned",
    "state_of",
]

STATE_ATTR = "_zero"


class ParamStatus(enum.Enum):
    """Where a partitioned parameter's full data is."""

    NOT_AVAILABLE = "not_available"
    """Only this rank's shard is here; the parameter's storage is empty."""
    INFLIGHT = "inflight"
    """An all-gather was issued and not waited for yet."""
    AVAILABLE = "available"
    """The full data is here (gathered, materialised, or persistent)."""


class PartitionedParameterError(RuntimeError):
    """A partitioned parameter was used where its full data is needed but not gathered."""


@dataclasses.dataclass(eq=False, slots=True)
class UnshardedStorage:
    """The one full-size storage of a partitioned parameter, kept for its whole life."""

    flat: torch.Tensor | None = None
    fills: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds right now (0 while released)."""
        return 0 if self.flat is None else self.flat.untyped_storage().nbytes()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Give the storage its full size back (allocating it on first use) and return :attr:`flat`.

        A new geometry (the parameter was reassigned another shape or dtype) gets a new
        storage; the old one is emptied first.
        """
        flat = self.flat
        if flat is None or flat.numel() != numel or flat.dtype != dtype or flat.device != device:
            self.free()
            flat = torch.empty(numel, dtype=dtype, device=device)
            self.flat = flat
        else:
            storage = flat.untyped_storage()
            need = numel * flat.element_size()
            if storage.nbytes() != need:
                storage.resize_(need)
        self.fills += 1
        return flat

    def free(self) -> None:
        """Resize the storage to 0 bytes (its tensors, saved views included, stay valid objects)."""
        if self.flat is not None and self.flat.untyped_storage().nbytes():
            self.flat.untyped_storage().resize_(0)


class SavedTensorGuard:
    """Names the parameter when autograd reads a saved view of a released gathered storage."""

    __slots__ = ("_hooks", "_states")

    def __init__(self, states: Callable[[], Sequence[ShardedParam]]) -> None:
        self._states = states
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []

    @property
    def active(self) -> bool:
        """Whether the hooks are pushed (between :meth:`__enter__` and :meth:`__exit__`)."""
        return bool(self._hooks)

    def __enter__(self) -> SavedTensorGuard:
        outer = _active_saved_tensors_hooks()
        if outer is None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_keep, self._unpack)
        else:  # the caller's hooks (e.g. save_on_cpu) keep working: ours wrap them
            pack, unpack = outer
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda kept: self._unpack(unpack(kept)))
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(*exc)

    def _unpack(self, saved: torch.Tensor) -> torch.Tensor:
        if saved.numel() and not saved.untyped_storage().nbytes():
            raise PartitionedParameterError(self._describe(saved))
        return saved

    def _describe(self, saved: torch.Tensor) -> str:
        key = saved.untyped_storage()._cdata
        owner = next(
            (
                st.display_name
                for st in self._states()
                if st.unsharded.flat is not None and st.unsharded.flat.untyped_storage()._cdata == key
            ),
            None,
        )
        what = f"parameter {owner!r}" if owner else "a released tensor (no parameter this guard knows)"
        return (
            f"backward read the copy autograd saved in forward of {what} (shape {tuple(saved.shape)}), "
            "but its gathered storage was released and not gathered again: zero_coord gathers a module's "
            "parameters before that module's backward, so this op runs outside the module that used "
            "the parameter (a hook of yours, or a checkpointed function that escapes the hooked "
            "modules). Gather it around that code (zero_params.GatheredParameters, or "
            "Coordinator.fetch(module) before and release(module) after), use the parameter inside "
            "the module that owns it, or register it with zero_params.register_external_parameter"
        )


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _active_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost ``saved_tensors_hooks`` pair in effect (``None``: none), which ours would shadow."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class ShardHome(Protocol):
    """Where offloaded shards live (implemented by :class:`zero_params.OffloadedShards`).

    A parameter whose :attr:`ShardedParam.offload` is set does not keep its values in
    :attr:`ShardedParam.shard` (an empty placeholder while they are on NVMe): every reader
    goes through the home.
    """

    def upload(self, states: Sequence[ShardedParam]) -> list[torch.Tensor]:
        """The shards' current values on their gather device (safe to read after the call returns)."""
        ...

    def replace(self, state: ShardedParam, values: torch.Tensor) -> None:
        """Store new values of ``state``'s shard (``partition_numel`` elements)."""
        ...


@dataclasses.dataclass(eq=False, slots=True)
class ShardedParam:
    """Everything ZeRO-3 knows about one parameter (``param._zero``).

    The parameter is flattened, zero-padded to :attr:`padded_numel` (a multiple of the
    group size) and cut into ``group_size`` partitions of :attr:`partition_numel`
    elements; group rank ``r`` keeps partition ``r`` in :attr:`shard`.
    """

    id: int
    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    numel: int
    group: ProcessGroup | None
    group_ranks: tuple[int, ...]
    group_size: int
    group_rank: int
    shard: torch.Tensor
    gather_strategy: AllGatherStrategy
    reduce_strategy: ReduceScatterStrategy
    persistent: bool = False
    status: ParamStatus = ParamStatus.NOT_AVAILABLE
    handle: Any = None
    unsharded: UnshardedStorage = dataclasses.field(default_factory=UnshardedStorage)
    secondary_strategy: AllGatherStrategy | None = None
    secondary_shard: torch.Tensor | None = None
    secondary_valid: bool = False
    grad_partition: torch.Tensor | None = None
    offload: ShardHome | None = None

    def __repr__(self) -> str:
        return (
            f"ShardedParam(name={self.name!r}, shape={tuple(self.shape)}, dtype={_dtype_name(self.dtype)}, "
            f"status={self.status.name}, persistent={self.persistent}, shard={self.partition_numel} of "
            f"{self.padded_numel} elements, group_rank={self.group_rank}/{self.group_size})"
        )

    @property
    def partition_numel(self) -> int:
        """Elements of one partition: ``ceil(numel / group_size)``."""
        return partition_numel(self.numel, self.group_size)

    @property
    def padded_numel(self) -> int:
        """``group_size * partition_numel``."""
        return padded_numel(self.numel, self.group_size)

    @property
    def shard_range(self) -> tuple[int, int]:
        """The real (unpadded) elements ``[start, stop)`` of the flattened parameter this rank owns."""
        return shard_range(self.numel, self.group_size, self.group_rank)

    @property
    def grad_dtype(self) -> torch.dtype:
        """dtype of :attr:`grad_partition`: fp32, or fp64 for fp64 parameters."""
        return torch.promote_types(self.dtype, torch.float32)

    @property
    def display_name(self) -> str:
        """The name, or a description when the name is unknown."""
        return self.name or f"<unnamed parameter of shape {tuple(self.shape)}>"

    def ensure_grad_partition(self) -> torch.Tensor:
        """Return :attr:`grad_partition`, allocating a zero-filled one if none is bound."""
        if self.grad_partition is None:
            self.grad_partition = torch.zeros(
                self.partition_numel, dtype=self.grad_dtype, device=self.shard.device
            )
        return self.grad_partition

    def bind_grad_partition(self, view: torch.Tensor) -> None:
        """Make ``view`` (e.g. a slice of an optimizer's flat fp32 buffer) the gradient partition.

        The current accumulated values (if any) are copied into ``view``; later
        :func:`zero_params.reduce_scatter_grads` calls accumulate into it in place.
        """
        _check_view(view, self.partition_numel, self.grad_dtype, f"grad partition of {self.display_name}")
        if self.grad_partition is not None and self.grad_partition is not view:
            view.copy_(self.grad_partition)
        self.grad_partition = view

    def unbind_grad_partition(self) -> None:
        """Forget the gradient partition: its owner (an optimizer's flat group) freed it after a step.

        The next :meth:`bind_grad_partition` binds a new one; without it, the next reduction
        allocates a zero-filled one (:meth:`ensure_grad_partition`).
        """
        self.grad_partition = None

    def bind_shard(self, view: torch.Tensor) -> None:
        """Make ``view`` (e.g. a slice of an optimizer's flat buffer) the storage of :attr:`shard`.

        The current shard values are copied into ``view``. After an in-place update of
        the shard, call :func:`zero_params.commit_shards`.
        """
        _check_view(view, self.partition_numel, self.dtype, f"shard of {self.display_name}")
        if self.status is ParamStatus.INFLIGHT:
            raise PartitionedParameterError(
                f"cannot rebind the shard of {self.display_name} while it is being gathered: wait() first"
            )
        if view is not self.shard:
            view.copy_(self.shard)
        self.shard = view


def _check_view(view: torch.Tensor, numel: int, dtype: torch.dtype, what: str) -> None:
    if not isinstance(view, torch.Tensor) or view.dim() != 1 or not view.is_contiguous():
        shape = tuple(view.shape) if isinstance(view, torch.Tensor) else type(view).__name__
        raise ValueError(f"{what}: expected a contiguous 1-D tensor, got {shape}")
    if view.numel() != numel or view.dtype != dtype:
        raise ValueError(
            f"{what}: expected {numel} elements of {dtype} (the partition size), "
            f"got {view.numel()} of {view.dtype}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_of(param: torch.Tensor) -> ShardedParam:
    """The :class:`ShardedParam` of a partitioned parameter.

    Raises:
        TypeError: ``param`` was never partitioned (use :func:`is_partitioned` to test).
    """
    state = getattr(param, STATE_ATTR, None)
    if not isinstance(state, ShardedParam):
        raise TypeError(
            f"this {type(param).__name__} of shape {tuple(param.shape)} is not partitioned: "
            "partition it with zero_params.partition(...) or build it under zero_params.Init(...)"
        )
    return state


def is_partitioned(param: object) -> bool:
    """Whether ``param`` is a parameter with a :class:`ShardedParam` (persistent ones included)."""
    return isinstance(getattr(param, STATE_ATTR, None), ShardedParam)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The real shape of ``param``, also while only its shard is on this rank."""
    state = getattr(param, STATE_ATTR, None)
    if isinstance(state, ShardedParam):
        return state.shape
    return param.shape


# ----------------------------------------------------------------------------------------
# The NOT_AVAILABLE parameter class
# ----------------------------------------------------------------------------------------

# Attributes (getters and setters) that never read the parameter's values.
_META_ATTRS = frozenset(
    {
        "requires_grad", "grad", "grad_fn", "is_leaf", "retains_grad", "dtype", "device", "layout",
        "shape", "ndim", "names", "name", "_base", "_version", "output_nr", "is_cuda", "is_cpu",
        "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
        "itemsize", "nbytes", "_cdata", "_backward_hooks", "_post_accumulate_grad_hooks",
        "__dict__",
    }
)  # fmt: skip
# Methods that only look at metadata or hooks.
_META_METHODS = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
        "is_contiguous", "element_size", "is_floating_point", "is_complex", "is_signed",
        "get_device", "requires_grad_", "retain_grad", "register_hook",
        "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr", "is_shared",
        "is_pinned", "_is_view", "__format__", "__setstate__",
    }
)  # fmt: skip


def _func_label(func: Callable[..., Any]) -> tuple[str, str]:
    """``(kind, name)``: kind is ``"get"`` / ``"set"`` for attributes, ``"call"`` otherwise."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return ("get" if name == "__get__" else "set"), getattr(owner, "__name__", "?")
    return "call", name


_MODULE_ALIASES = {"torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch"}


def describe_func(func: Callable[..., Any]) -> str:
    """A readable name of a torch function for error messages."""
    kind, name = _func_label(func)
    if kind == "get":
        return f"reading Tensor.{name}"
    if kind == "set":
        return f"assigning Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", name)
    qual = qual.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
    if "." in qual:
        return qual
    module = _MODULE_ALIASES.get(module, module)
    return f"{module}.{qual}" if module else qual


def is_metadata_func(func: Callable[..., Any]) -> bool:
    """Whether ``func`` only reads metadata (shape, dtype, hooks, ...) of its tensor argument."""
    kind, name = _func_label(func)
    if kind == "call":
        return name in _META_METHODS
    if kind == "get":
        return name in _META_ATTRS
    return name in ("grad", "requires_grad", "name", "names")


def not_available_error(state: ShardedParam, what: str) -> PartitionedParameterError:
    """The error raised when ``what`` needs the data of a parameter that is not gathered."""
    head = (
        f"parameter {state.display_name!r} (shape {tuple(state.shape)}, {_dtype_name(state.dtype)}) "
        f"is partitioned over {state.group_size} rank(s) and is {state.status.name} on this rank, "
        f"so {what} cannot use it."
    )
    if state.status is ParamStatus.INFLIGHT:
        return PartitionedParameterError(
            f"{head} Its all-gather is in flight: call .wait() on the handle zero_params.gather() returned."
        )
    return PartitionedParameterError(
        f"{head} Gather it first: `with zero_params.GatheredParameters(param): ...` "
        "(add modifier_rank=0 to keep in-place edits), or `zero_params.gather([param]).wait()` and "
        "zero_params.release([param]) afterwards; in training, run the module through the zero engine, "
        "whose module hooks gather parameters before forward and backward."
    )


class PartitionedParameter(nn.Parameter):
    """The class of a partitioned parameter while its data is not on this rank.

    Never instantiate it: :func:`zero_params.partition` switches a parameter's class to it
    on release and back to ``nn.Parameter`` once the data is gathered (see the module
    docstring). Metadata queries (``dtype``, ``requires_grad``, hooks, the storage's empty
    ``shape``) work; any use of the values raises :class:`PartitionedParameterError`.
    """

    _zero: ShardedParam

    def __new__(cls, *args: Any, **kwargs: Any) -> PartitionedParameter:
        raise TypeError(
            "PartitionedParameter is not constructed directly: build an nn.Parameter and "
            "partition it with zero_params.partition(...) or under zero_params.Init(...)"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not is_metadata_func(func):
            for a in _iter_args(args, kwargs):
                state = getattr(a, STATE_ATTR, None) if type(a) is PartitionedParameter else None
                if state is not None and state.status is not ParamStatus.AVAILABLE:
                    raise not_available_error(state, describe_func(func))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        state = getattr(self, STATE_ATTR, None)
        if not isinstance(state, ShardedParam):
            return "PartitionedParameter(<no state>)"
        return (
            f"PartitionedParameter(name={state.name!r}, shape={tuple(state.shape)}, "
            f"dtype={_dtype_name(state.dtype)}, status={state.status.name}, shard={state.partition_numel} "
            f"of {state.padded_numel} elements on group rank {state.group_rank}/{state.group_size})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = getattr(self, STATE_ATTR, None)
        name = state.display_name if isinstance(state, ShardedParam) else "?"
        raise PartitionedParameterError(
            f"cannot pickle partitioned parameter {name!r}: its data is spread over ranks. Save "
            "zero_params.state_of(param).shard per rank, or gather it (GatheredParameters) and save a copy."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        state = getattr(self, STATE_ATTR)
        with torch._C.DisableTorchFunction():
            copy = nn.Parameter(torch.empty(0, dtype=state.dtype, device=state.device), self.requires_grad)
            home = state.offload
            shard = home.upload([state])[0].clone() if home is not None else state.shard.clone()
        new_state = dataclasses.replace(
            state,
            status=ParamStatus.NOT_AVAILABLE,
            shard=shard,
            handle=None,
            unsharded=UnshardedStorage(),
            secondary_shard=None,
            secondary_valid=False,
            grad_partition=None,
            offload=None,
        )
        new_state.id = id(new_state)
        setattr(copy, STATE_ATTR, new_state)
        copy.__class__ = PartitionedParameter
        memo[id(self)] = copy
        return copy


def _iter_args(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """Top-level arguments, and the items of list / tuple arguments (e.g. ``torch.cat``)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, (list, tuple)):
                yield from a
            else:
                yield a
