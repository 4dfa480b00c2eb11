"""The configuration reference, rendered from the config sections themselves.

:func:`config_keys` walks :class:`~zero_full.config.ZeroConfig` and its sections and
describes every key a config accepts: its DeepSpeed path, the other accepted spellings,
the type and range its validator enforces, the default, the stages that use it
(``KNOB_STAGES``) and its description (the field's docstring, the section's
``Attributes:`` entry, or a note kept below). :func:`render_markdown` turns that into the
documentation site's configuration page (a mkdocs hook inserts it at build time), so the
page cannot drift from the code.

>>> keys = {k.path: k for k in config_keys()}
>>> keys["zero_optimization.stage3_prefetch_bucket_size"].spellings
('stage3_prefetch_bucket_size', 'prefetch_bucket_size')
>>> keys["zero_optimization.stage3_prefetch_bucket_size"].stages
(3,)
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from zero_full.config import ZeroConfig
from zero_full.config_sections import (
    KNOB_STAGES,
    AdamParams,
    OptimizerConfig,
    SGDParams,
    ZeroOptimizationConfig,
    _check_betas,
    _check_flag,
    _check_int,
    _check_path,
    _check_real,
    _choice,
    _Section,
)

__all__ = ["ALL_STAGES", "ConfigKey", "SectionDoc", "config_keys", "config_sections", "render_markdown"]

ALL_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""Stages that use a key with no entry in ``KNOB_STAGES``."""

# Descriptions of fields that carry no docstring in the code (the code's docstrings win).
# Keyed by (section class name, field name); the unit tests require one for every key.
_NOTES: dict[tuple[str, str], str] = {
    ("FP16Config", "enabled"): "Train in fp16 with loss scaling (working copies of parameters and "
    "gradients in fp16, fp32 master weights and optimizer state).",
    ("FP16Config", "loss_scale"): "0: dynamic loss scaling; a positive value: this static scale.",
    ("FP16Config", "initial_scale_power"): "Dynamic scaling starts at `2**initial_scale_power`.",
    ("FP16Config", "loss_scale_window"): "Overflow-free steps after which the dynamic scale doubles.",
    ("FP16Config", "hysteresis"): "Overflows absorbed before the dynamic scale halves.",
    ("FP16Config", "consecutive_hysteresis"): "Refill the hysteresis budget after every "
    "overflow-free step (not only after `loss_scale_window` of them).",
    ("FP16Config", "min_loss_scale"): "The dynamic scale never halves below this.",
    ("BF16Config", "enabled"): "Train in bfloat16 (working copies of parameters and gradients in "
    "bf16, fp32 master weights and optimizer state); no loss scaling.",
    ("OptimizerConfig", "type"): "`Adam`, `AdamW` or `SGD`, any case. `Adam` with `adam_w_mode` "
    "(the default) builds `torch.optim.AdamW`, as DeepSpeed does.",
    ("OptimizerConfig", "params"): "The optimizer's keyword arguments, checked for its `type` "
    "(tables below). Omitted: every default.",
    ("AdamParams", "lr"): "Learning rate.",
    ("AdamParams", "betas"): "Coefficients of the running averages of the gradient and its square.",
    ("AdamParams", "eps"): "Term added to the denominator.",
    ("AdamParams", "weight_decay"): "Weight decay; DeepSpeed's default 0.0 (torch's `AdamW` "
    "defaults to 0.01).",
    ("AdamParams", "amsgrad"): "The AMSGrad variant.",
    ("SGDParams", "lr"): "Learning rate.",
    ("SGDParams", "momentum"): "Momentum factor.",
    ("SGDParams", "dampening"): "Dampening of the momentum.",
    ("SGDParams", "weight_decay"): "L2 penalty.",
    ("SGDParams", "nesterov"): "Nesterov momentum (needs `momentum` > 0 and `dampening` 0).",
    ("ZeroOptimizationConfig", "stage"): "0: plain data parallelism (DDP); 1: optimizer state "
    "sharded; 2: + gradients; 3: + parameters.",
    ("ZeroOptimizationConfig", "overlap_comm"): "Reduce gradient buckets asynchronously while "
    "backward goes on. Never changes the numbers.",
    ("ZeroOptimizationConfig", "contiguous_gradients"): "Accepted for DeepSpeed compatibility: zero "
    "always reduces gradients into one contiguous flat partition per parameter group.",
    ("ZeroOptimizationConfig", "reduce_scatter"): "Accepted for DeepSpeed compatibility: stages "
    "1-3 always reduce-scatter gradients, stage 0 (DDP) all-reduces them.",
    ("ZeroOptimizationConfig", "reduce_bucket_size"): "Gradient elements reduced in one bucket "
    "(one collective) during backward.",
    ("ZeroOptimizationConfig", "allgather_partitions"): "Accepted for DeepSpeed compatibility: "
    "stages 1/2 always all-gather the updated partitions after the step.",
    ("ZeroOptimizationConfig", "allgather_bucket_size"): "Stages 1/2: elements of whole parameters "
    "all-gathered in one collective after the step.",
    ("ZeroOptimizationConfig", "round_robin_gradients"): "Accepted for DeepSpeed compatibility "
    "(its gradient placement for CPU offload); no effect in zero.",
    ("ZeroOptimizationConfig", "prefetch_bucket_size"): "Stage 3: elements of upcoming modules' "
    "parameters gathered ahead of use, from the recorded trace; 0 turns prefetching off.",
    ("ZeroOptimizationConfig", "param_persistence_threshold"): "Stage 3: parameters with at most "
    "this many elements are not partitioned (kept whole on every rank, never gathered).",
    ("ZeroOptimizationConfig", "model_persistence_threshold"): "Accepted for DeepSpeed "
    "compatibility (a cap on the total elements kept whole); not applied by zero yet.",
    ("ZeroOptimizationConfig", "max_live_parameters"): "Stage 3: bound on gathered or in-flight "
    "elements that prefetching and reuse may keep alive (the running module's parameters are "
    "always gathered).",
    ("ZeroOptimizationConfig", "max_reuse_distance"): "Stage 3: a parameter used again within "
    "this many gathered elements (in the trace) stays gathered after its module.",
    ("ZeroOptimizationConfig", "gather_16bit_weights_on_model_save"): "Accepted for DeepSpeed "
    "compatibility (its `save_16bit_model`); with zero use `engine.consolidated_state_dict()` "
    "or `zero consolidate` for whole weights.",
    ("ZeroOptimizationConfig", "zero_hpz_partition_size"): "Stage 3, ZeRO++ hpZ: ranks holding "
    "a secondary shard of the parameters (usually the ranks of one node; must divide the world "
    "size and the ranks per node); backward gathers stay inside the node; costs Ψ/n elements per "
    "rank. 1 is off. See [ZeRO++](zeropp.md).",
    ("ZeroOptimizationConfig", "zero_quantized_weights"): "Stage 3, ZeRO++ qwZ: all-gather "
    "parameters as int8 codes + fp32 scales, dequantized on arrival; masters and optimizer stay "
    "exact. See [ZeRO++](zeropp.md).",
    ("ZeroOptimizationConfig", "zero_quantized_nontrainable_weights"): "Stage 3: keep frozen "
    "weights quantized. Accepted, no effect yet (listed as ignored); see [ZeRO++](zeropp.md).",
    ("ZeroOptimizationConfig", "zero_quantized_gradients"): "Stage 3, ZeRO++ qgZ: reduce "
    "gradients quantized to int4 with two all-to-all hops (inside the node, then across); 1-D and "
    "indivisible tensors exactly. Needs a world of whole nodes. See [ZeRO++](zeropp.md).",
    ("ZeroOptimizationConfig", "mics_hierarchical_params_gather"): "Stage 3, MiCS: gather "
    "parameters in two hops (inside a node, then across).",
    ("ZeroOptimizationConfig", "offload_param"): "Stage 3: where parameters live between uses "
    "(section below).",
    ("ZeroOptimizationConfig", "offload_optimizer"): "Where the optimizer state and its step live "
    "(section below).",
    ("OffloadParamConfig", "device"): "`none`, `cpu` or `nvme`.",
    ("OffloadParamConfig", "nvme_path"): "Directory for swap files; required with `nvme`.",
    ("OffloadParamConfig", "buffer_count"): "Swap buffers for parameters.",
    ("OffloadParamConfig", "buffer_size"): "Elements per swap buffer.",
    ("OffloadParamConfig", "max_in_cpu"): "Elements of parameters kept in CPU memory with `nvme`.",
    ("OffloadParamConfig", "pin_memory"): "Page-locked CPU buffers (faster copies to an accelerator).",
    ("OffloadOptimizerConfig", "device"): "`none`, `cpu` or `nvme`.",
    ("OffloadOptimizerConfig", "nvme_path"): "Directory for swap files; required with `nvme`.",
    ("OffloadOptimizerConfig", "buffer_count"): "Swap buffers for optimizer state.",
    ("OffloadOptimizerConfig", "pin_memory"): "Page-locked CPU buffers (faster copies to an accelerator).",
    ("OffloadOptimizerConfig", "pipeline_read"): "Overlap reading swapped state with the step.",
    ("OffloadOptimizerConfig", "pipeline_write"): "Overlap writing swapped state with the step.",
    ("OffloadOptimizerConfig", "fast_init"): "Skip initialising swap files on creation.",
    ("OffloadOptimizerConfig", "ratio"): "Fraction of each group's sub-groups whose optimizer step and "
    "state are offloaded (< 1: partial offload, stage 3 only; the rest is stepped on the device; the split "
    "is `engine.optimizer.offload.offloaded_numel` / `device_numel`).",
}

# Defaults the field cannot state because the section computes them.
_DEFAULT_NOTES: dict[tuple[str, str], str] = {
    ("ZeroOptimizationConfig", "overlap_comm"): "`true` at stage 3, else `false`",
    ("ZeroOptimizationConfig", "model_persistence_threshold"): "unlimited (`sys.maxsize`)",
}


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One accepted key of the configuration.

    Attributes:
        section: Path of the section holding it (``("zero_optimization",)``; ``()``: top level).
        field: The attribute name on the validated section object.
        spellings: Every accepted spelling, DeepSpeed's documented one first.
        type: What the validator accepts (``"int >= 1"``, ``"bool"``, ``"object"``, ...).
        default: The default value (``None`` for "not given"); ``PydanticUndefined`` when required.
        default_text: The default as shown on the page.
        stages: The ZeRO stages that use the key (the others ignore it).
        description: Markdown text.
    """

    section: tuple[str, ...]
    field: str
    spellings: tuple[str, ...]
    type: str
    default: Any
    default_text: str
    stages: tuple[int, ...]
    description: str

    @property
    def name(self) -> str:
        """DeepSpeed's documented spelling."""
        return self.spellings[0]

    @property
    def path(self) -> str:
        """The full dotted path with DeepSpeed's spelling, e.g. ``zero_optimization.stage``."""
        return ".".join((*self.section, self.name))


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    """One section of the configuration and its keys.

    Attributes:
        path: Where it sits (``()``: top level).
        title: Heading text.
        cls: The pydantic section class.
        intro: Markdown paragraph describing the section.
        keys: Its keys, in declaration order.
    """

    path: tuple[str, ...]
    title: str
    cls: type[_Section]
    intro: str
    keys: tuple[ConfigKey, ...]


# --------------------------------------------------------------------------- introspection


def _rst_to_md(text: str) -> str:
    """Docstring text (reST inline markup) as one markdown paragraph."""
    text = re.sub(r":(?:class|meth|func|attr|mod):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


@functools.cache
def _field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after ``name: T = ...``) of ``cls`` itself."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # pragma: no cover - source not available
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


@functools.cache
def _attributes_section(cls: type) -> dict[str, str]:
    """Entries of the Google-style ``Attributes:`` section of ``cls``'s docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)*)", doc, re.MULTILINE)
    if match is None:
        return {}
    entries: dict[str, str] = {}
    current = None
    for line in textwrap.dedent(match.group(1)).splitlines():
        head = re.match(r"^(\w+):\s*(.*)$", line)
        if head:
            current = head.group(1)
            entries[current] = head.group(2)
        elif current is not None and line.strip():
            entries[current] += " " + line.strip()
    return entries


def _first_paragraph(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return doc.split("\n\n")[0]


def _description(cls: type[_Section], field: str) -> str:
    text = _field_docstrings(cls).get(field) or _attributes_section(cls).get(field)
    if text:
        return _rst_to_md(text.split("\n\n")[0] if "\n\n" in text else text)
    return _NOTES.get((cls.__name__, field), "")


def _sections_in(annotation: Any) -> list[type[_Section]]:
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return [annotation]
    found: list[type[_Section]] = []
    for arg in typing.get_args(annotation):
        found += [s for s in _sections_in(arg) if s not in found]
    return found


def _validator(info: FieldInfo) -> Any:
    return next((m.func for m in info.metadata if isinstance(m, BeforeValidator)), None)


def _fmt_number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _type_text(info: FieldInfo) -> str:
    """What the field's validator accepts, e.g. ``int in [0, 3]``."""
    sections = _sections_in(info.annotation)
    if sections:
        nullable = type(None) in typing.get_args(info.annotation)
        return "object or null" if nullable else "object"
    check = _validator(info)
    base = check.func if isinstance(check, functools.partial) else check
    kw = check.keywords if isinstance(check, functools.partial) else {}
    if base is _check_int or base is _check_real:
        kind = "int" if base is _check_int else "number"
        lo, hi = kw.get("lo"), kw.get("hi")
        lo_op = ">" if kw.get("lo_open") else ">="
        hi_op = "<" if kw.get("hi_open") else "<="
        if lo is not None and hi is not None:
            left, right = ("(" if kw.get("lo_open") else "["), (")" if kw.get("hi_open") else "]")
            text = f"{kind} in {left}{_fmt_number(lo)}, {_fmt_number(hi)}{right}"
        elif lo is not None:
            text = f"{kind} {lo_op} {_fmt_number(lo)}"
        elif hi is not None:
            text = f"{kind} {hi_op} {_fmt_number(hi)}"
        else:
            text = kind
        return text + (" or null" if kw.get("none_ok") else "")
    if base is _check_flag:
        return "bool"
    if base is _check_path:
        return "path or null"
    if base is _check_betas:
        return "[number, number] in [0, 1)"
    if base is _choice and check.args:
        return " | ".join(f'`"{m.value}"`' for m in check.args[0])
    enum_cls = next((a for a in (info.annotation, *typing.get_args(info.annotation)) if _is_enum(a)), None)
    if enum_cls is not None:
        return " | ".join(f'`"{m.value}"`' for m in enum_cls)
    return getattr(info.annotation, "__name__", str(info.annotation))


def _is_enum(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, enum.Enum)


def _default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def _default_text(cls: type[_Section], field: str, info: FieldInfo) -> str:
    if (cls.__name__, field) in _DEFAULT_NOTES:
        return _DEFAULT_NOTES[(cls.__name__, field)]
    if _sections_in(info.annotation) and info.default is not None:
        return "(section)"
    value = _default_of(info)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        return f'`"{value.value}"`'
    if isinstance(value, tuple):
        return f"`[{', '.join(_fmt_number(v) for v in value)}]`"
    if isinstance(value, int) and value >= 10_000 and value != sys.maxsize:
        mantissa, exp = f"{value:e}".split("e")
        short = f"{float(mantissa):g}e{int(exp)}"
        return f"`{value}` ({short})" if float(short) == value else f"`{value}`"
    return f"`{_fmt_number(value)}`"


def _keys_of(cls: type[_Section], path: tuple[str, ...], stages: tuple[int, ...]) -> tuple[ConfigKey, ...]:
    keys = []
    for field, info in cls.model_fields.items():
        spellings = cls._ALIASES.get(field, (field,))
        spellings = tuple(dict.fromkeys((*spellings, field)))
        own = stages
        if cls is ZeroOptimizationConfig and field in KNOB_STAGES:
            own = tuple(sorted(KNOB_STAGES[field]))
        keys.append(
            ConfigKey(
                section=path,
                field=field,
                spellings=spellings,
                type=_type_text(info),
                default=_default_of(info),
                default_text=_default_text(cls, field, info),
                stages=own,
                description=_description(cls, field),
            )
        )
    return tuple(keys)


def config_sections() -> list[SectionDoc]:
    """Every section of :class:`ZeroConfig`, depth first, with its keys.

    ``optimizer.params`` appears once per parameter class (Adam / AdamW, SGD).
    """
    docs: list[SectionDoc] = []

    def visit(cls: type[_Section], path: tuple[str, ...], title: str, stages: tuple[int, ...]) -> None:
        keys = _keys_of(cls, path, stages)
        docs.append(SectionDoc(path, title, cls, _rst_to_md(_first_paragraph(cls)), keys))
        for key in keys:
            info = cls.model_fields[key.field]
            children = _sections_in(info.annotation)
            if cls is OptimizerConfig and key.field == "params":
                children = [AdamParams, SGDParams]
            for child in children:
                child_path = (*path, key.name)
                label = ".".join(child_path)
                if cls is OptimizerConfig:
                    kinds = "Adam / AdamW" if child is AdamParams else "SGD"
                    label = f"{label} ({kinds})"
                visit(child, child_path, label, key.stages)

    visit(ZeroConfig, (), "Top level", ALL_STAGES)
    return docs


def config_keys() -> Iterator[ConfigKey]:
    """Every key of every section (see :func:`config_sections`)."""
    for section in config_sections():
        yield from section.keys


# --------------------------------------------------------------------------- markdown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _stages_text(stages: tuple[int, ...]) -> str:
    return "all" if stages == ALL_STAGES else ", ".join(str(s) for s in stages)


def _hints(cls: type[_Section]) -> dict[str, str]:
    return dict(cls._HINTS)


def render_markdown(heading_level: int = 2) -> str:
    """The configuration reference as markdown: one table per section, then refused keys.

    Args:
        heading_level: Level of the section headings (2: ``##``).

    Returns:
        Markdown text: for each section a heading, its description and a table of its keys
        (key and other spellings, type, default, stages, description), then a table of the
        DeepSpeed keys zero refuses with the reason given in the error.
    """
    hashes = "#" * heading_level
    out: list[str] = []
    refused: dict[str, str] = {}
    for section in config_sections():
        out += [f"{hashes} {'`' + section.title + '`' if section.path else section.title}", ""]
        if section.intro:
            out += [section.intro, ""]
        out += ["| key | type | default | stages | description |", "| --- | --- | --- | --- | --- |"]
        for key in section.keys:
            name = f"`{key.name}`"
            if len(key.spellings) > 1:
                name += " (also " + ", ".join(f"`{s}`" for s in key.spellings[1:]) + ")"
            cells = (name, key.type, key.default_text, _stages_text(key.stages), key.description)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
        prefix = ".".join(section.path)
        for key, why in _hints(section.cls).items():
            refused.setdefault(f"{prefix}.{key}" if prefix else key, _rst_to_md(why))
    out += [
        f"{hashes} Keys that are refused",
        "",
        "DeepSpeed keys that zero does not take; the error names the key and says this:",
        "",
        "| key | what to do |",
        "| --- | --- |",
    ]
    out += [f"| `{key}` | {_cell(why)} |" for key, why in sorted(refused.items())]
    out.append("")
    return "\n".join(out)
