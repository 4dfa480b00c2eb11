"""Leaf modules: blocks whose whole subtree is gathered at entry and released at exit.

A leaf module is needed when the modules inside a block run data-dependently (mixture of
experts routing, early exits): with per-module hooks, ranks that take different paths would
issue different gathers and hang. Gathering the block's whole subtree at its entry makes
every rank issue the same collectives whatever runs inside; no hooks are installed inside.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterable

from torch import nn

import zero_params

__all__ = [
    "Granularity",
    "LeafRegistry",
    "coordinated_leaves",
    "find_leaf_modules",
    "granularity_leaves",
    "outermost_leaves",
    "set_leaf_modules",
]

_REGISTRY_ATTR = "_zero_coord_leaf_registry"
logger = logging.getLogger("zero.coord")


class LeafRegistry:
    """Qualified names (relative to the owning model) of the modules marked as leaves."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __repr__(self) -> str:
        return f"LeafRegistry({sorted(self.names)})"


def set_leaf_modules(model: nn.Module, classes_or_names: Iterable[type[nn.Module] | str]) -> list[nn.Module]:
    """Mark modules of ``model`` as ZeRO-3 leaf modules.

    Call before :meth:`Coordinator.install` (a coordinator reads the marking when it
    installs its hooks). Marking is additive across calls.
    """
    wanted = list(classes_or_names)
    for entry in wanted:
        if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
            raise TypeError(
                f"set_leaf_modules: {entry!r} is neither an nn.Module subclass nor a class or module name"
            )
    matched_entries: set[int] = set()
    marked: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        hits = [i for i, entry in enumerate(wanted) if _matches(entry, name, module)]
        if hits:
            matched_entries.update(hits)
            marked.append((name, module))
    unmatched = [wanted[i] for i in range(len(wanted)) if i not in matched_entries]
    if unmatched:
        shown = ", ".join(e if isinstance(e, str) else e.__name__ for e in unmatched)
        raise ValueError(
            f"set_leaf_modules: no module of {type(model).__name__} matches {shown}; pass module classes, "
            "class names or qualified names as listed by model.named_modules()"
        )
    registry = model.__dict__.get(_REGISTRY_ATTR)
    if registry is None:
        registry = LeafRegistry()
        # A plain (non-module, non-tensor) value: nn.Module.__setattr__ stores it in __dict__.
        setattr(model, _REGISTRY_ATTR, registry)
    registry.names.update(name for name, _ in marked)
    return [module for _, module in marked]


def _matches(entry: type[nn.Module] | str, name: str, module: nn.Module) -> bool:
    if isinstance(entry, str):
        return entry == name or entry == type(module).__name__
    return isinstance(module, entry)


def find_leaf_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The leaf modules marked anywhere inside ``model``, outermost only, by qualified name.

    A leaf inside another leaf is covered by the outer one and not returned.
    """
    marked: dict[str, nn.Module] = {}
    for prefix, owner in model.named_modules():
        registry = owner.__dict__.get(_REGISTRY_ATTR)
        if registry is None:
            continue
        for name, module in owner.named_modules():
            if name in registry.names:
                full = f"{prefix}.{name}" if prefix and name else (prefix or name)
                marked[full] = module
    return outermost_leaves(marked)


def outermost_leaves(marked: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The entries of ``marked`` (qualified name -> module) not inside another entry."""
    outermost: dict[str, nn.Module] = {}
    for name in sorted(marked, key=lambda n: (n.count("."), n) if n else (-1, n)):
        if not any(_is_inside(name, outer) for outer in outermost):
            outermost[name] = marked[name]
    return outermost


def _is_inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


# torch's container classes (ModuleList, Sequential, ModuleDict, ...): never leaves, as in
# DeepSpeed; a container's forward may never run (ModuleList), so its children keep their hooks.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_MAX_LEAF_ELEMENTS = 1_000_000_000  # DeepSpeed's cap: larger subtrees are never one leaf


@dataclasses.dataclass(frozen=True)
class Granularity:
    """Parameter elements per layer of one module's subtree (DeepSpeed's module granularity).

    Attributes:
        name: Qualified name of the module.
        elements: Parameter elements in its subtree (whole sizes, also while partitioned).
        layers: Modules with parameters in its subtree, itself included (torch containers
            and parameterless modules do not count).
    """

    name: str
    elements: int
    layers: int

    @property
    def value(self) -> int:
        """``elements // layers``; ``sys.maxsize`` where it can never be a leaf."""
        if self.layers == 0 or self.elements > _MAX_LEAF_ELEMENTS:
            return sys.maxsize
        return self.elements // self.layers


def _granularities(model: nn.Module) -> dict[str, Granularity]:
    """Every module's :class:`Granularity` (modules that can never be leaves have none)."""
    found: dict[str, Granularity] = {}

    def visit(name: str, module: nn.Module) -> tuple[int, int]:
        own = sum(zero_params.full_shape(p).numel() for p in module.parameters(recurse=False))
        children = list(module.named_children())
        if not children:  # a torch leaf: one layer, never a leaf module of its own
            return (1, own) if own else (0, 0)
        layers, elements = 0, own
        for child_name, child in children:
            child_layers, child_elements = visit(f"{name}.{child_name}" if name else child_name, child)
            layers += child_layers
            elements += child_elements
        if elements == 0 or isinstance(module, _CONTAINERS):
            return layers, elements
        layers += 1
        found[name] = Granularity(name, elements, layers)
        return layers, elements

    visit("", model)
    return found


def granularity_leaves(model: nn.Module, threshold: int) -> tuple[list[str], Granularity | None]:
    """The modules DeepSpeed's ``stage3_module_granularity_threshold`` turns into leaves."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"granularity_leaves: threshold must be a non-negative int, got {threshold!r}")
    found = _granularities(model)
    smallest = min(found.values(), key=lambda g: g.value, default=None)
    if threshold == 0:
        return [], smallest
    leaves: list[str] = []
    for name in [name for name, _ in model.named_modules() if name in found]:  # parents first
        if found[name].value <= threshold and not any(_is_inside(name, leaf) for leaf in leaves):
            leaves.append(name)
    return leaves, smallest


def coordinated_leaves(model: nn.Module, threshold: int) -> dict[str, nn.Module]:
    """The modules a :class:`~zero_coord.Coordinator` of ``model`` gathers as leaves, by qualified name."""
    leaves = find_leaf_modules(model)
    if threshold == 0:
        return leaves
    chosen, smallest = granularity_leaves(model, threshold)
    if not chosen:
        if smallest is None:
            logger.warning(
                "module_granularity_threshold %d selects no module: no module of %s can be a leaf "
                "(only single layers and torch containers hold parameters)",
                threshold,
                type(model).__name__,
            )
        else:
            logger.warning(
                "module_granularity_threshold %d selects no module: the smallest granularity is %d "
                "(%s); set the threshold to at least that to gather such blocks as one leaf",
                threshold,
                smallest.value,
                smallest.name or "<root>",
            )
        return leaves
    modules = dict(model.named_modules())
    logger.info(
        "module_granularity_threshold %d: %d module(s) gathered as leaves: %s",
        threshold,
        len(chosen),
        ", ".join(name or "<root>" for name in chosen),
    )
    _warn_of_large_leaves(model, threshold, {name: modules[name] for name in chosen})
    return outermost_leaves({**leaves, **{name: modules[name] for name in chosen}})


def _warn_of_large_leaves(model: nn.Module, threshold: int, chosen: dict[str, nn.Module]) -> None:
    """A leaf holding most of the model is gathered whole: say so (a threshold above a
    parent's granularity, e.g. of a model made almost only of blocks, picks the parent)."""

    def elements(module: nn.Module) -> int:
        return sum(zero_params.full_shape(p).numel() for p in set(module.parameters()))

    total = elements(model)
    for name, module in chosen.items():
        inside = elements(module)
        if inside * 2 > total:
            logger.warning(
                "module_granularity_threshold %d makes %s one leaf: %d of the model's %d parameter "
                "elements are gathered whole at once; lower the threshold below its granularity to "
                "gather the blocks inside it instead",
                threshold,
                name or "<root>",
                inside,
                total,
            )
