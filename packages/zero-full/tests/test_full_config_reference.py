"""The generated configuration reference: complete, and every claim on it checked against the config."""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest
from pydantic import ValidationError

from zero_full.config.base import Section, TypedSection
from zero_full.config.optimizer import OptimizerConfig
from zero_full.config.reference import ALL_STAGES, ConfigKey, config_keys, config_sections, render_markdown
from zero_full.config.types import Ignored, Refused
from zero_full.config.zero_config import ZeroConfig

KEYS = list(config_keys())
SGD_KEYS = next(s.keys for s in config_sections() if s.title == "optimizer.params (SGD)")


def _accepted(cls: type[Section], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """(section path, spelling) of every key accepted below ``cls``, found without config_reference."""
    found = [(path, key) for key in cls.accepted_keys()]
    for name, info in cls.model_fields.items():
        if issubclass(cls, TypedSection) and name == "params":
            children = list(cls.params_sections())
        else:
            args = (info.annotation, *typing.get_args(info.annotation))
            children = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
        for child in children:
            found += _accepted(child, (*path, cls.documented_key(name)))
    return found


def _page_sections(page: str) -> dict[str, str]:
    """Section path -> the markdown under its heading(s) (``optimizer.params`` has one per type)."""
    parts = re.split(r"^## (.+)$", page, flags=re.MULTILINE)
    sections: dict[str, str] = {}
    for i in range(1, len(parts), 2):
        path = parts[i].strip("`").split(" (")[0]
        sections[path] = sections.get(path, "") + parts[i + 1]
    return sections


def test_every_accepted_key_is_on_the_page_in_its_section():
    page = render_markdown()
    sections = _page_sections(page)
    missing = []
    for path, key in _accepted(ZeroConfig, ()):
        text = sections.get(".".join(path) or "Top level", "")
        if f"`{key}`" not in text:
            missing.append(".".join((*path, key)))
    assert not missing, f"keys ZeroConfig accepts but the reference page lacks: {missing}"
    assert len(KEYS) >= 60


def test_every_key_has_a_description():
    bare = [k.path for k in KEYS if not k.description.strip()]
    assert not bare, (
        f"config keys without a description: {bare}; add a docstring under the field in "
        "zero_full/config/ (its section's module)"
    )


def _minimal(key: ConfigKey) -> dict[str, Any]:
    """The smallest config in which ``key`` may be given (an optimizer type, stage 3 for ``ratio``)."""
    if key.section == ("optimizer",):
        return {"optimizer": {"type": "Adam"}}
    if key.section in (("optimizer", "params"), ("scheduler", "params")):
        return {key.section[0]: _typed_with(key)}
    if key.section == ("zero_optimization", "offload_optimizer"):
        return {"zero_optimization": {"stage": 3}}
    if key.section == ("zero_optimization", "zeropp_loco_param"):
        return {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    return {}


def _typed_with(key: ConfigKey) -> dict[str, Any]:
    """``{type, params}`` of the first type whose params hold ``key``, its required params set to 10."""
    title = f"{key.section[0]}.params ("
    section = next(s for s in config_sections() if s.title.startswith(title) and key in s.keys)
    kind = section.title.split("(")[1].split(" / ")[0].rstrip(")")
    required = {k.name: 10 for k in section.keys if k.default_text == "required"}
    return {"type": kind, "params": required}


def _config_with(key: ConfigKey, spelling: str, value: Any) -> dict[str, Any]:
    cfg = _minimal(key)
    node = cfg
    for part in key.section:
        node = node.setdefault(part, {})
    node[spelling] = value
    return cfg


def _value_of(cfg: ZeroConfig, key: ConfigKey) -> Any:
    obj: Any = cfg
    for part in key.section:
        name = {"bfloat16": "bf16"}.get(part, part)
        parent, obj = obj, getattr(obj, name)
        if obj is None:  # an optional section left out (zeropp_loco_param): its defaults
            obj = typing.get_args(type(parent).model_fields[name].annotation)[0]()
    return getattr(obj, key.field)


SCALARS = [k for k in KEYS if k.default_text not in ("(section)", "required") and k.type != "object"]


@pytest.mark.parametrize("key", SCALARS, ids=lambda k: k.path)
def test_every_spelling_is_accepted_and_the_default_is_the_configs(key):
    for spelling in key.spellings:
        cfg = ZeroConfig.model_validate(_config_with(key, spelling, _plain(key.default)))
        assert _value_of(cfg, key) == key.default, spelling
    # the default is also what an empty config gives (overlap_comm: its stage rule, tested below)
    if key.field != "overlap_comm":
        assert _value_of(ZeroConfig.model_validate(_minimal(key)), key) == key.default


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return getattr(value, "value", value)


def test_overlap_comm_default_follows_the_stage_as_the_page_says():
    (key,) = [k for k in KEYS if k.field == "overlap_comm"]
    assert key.default_text == "`true` at stage 3, else `false`"
    for stage in ALL_STAGES:
        cfg = ZeroConfig.model_validate({"zero_optimization": {"stage": stage}})
        assert cfg.zero_optimization.overlap_comm is (stage == 3)


RANGED = [k for k in SCALARS if re.match(r"(int|number) (>=|>|in) ", k.type)]


@pytest.mark.parametrize("key", RANGED, ids=lambda k: k.path)
def test_stated_ranges_are_the_validators(key):
    num = r"(-?[\d.e+]+)"
    match = re.match(rf"(int|number) (?:(>=|>) {num}|in ([\[(]){num}, {num}([\])]))", key.type)
    assert match, key.type
    kind, op, lo, left, lo2, hi, right = match.groups()
    step = 1 if kind == "int" else 0.5
    low = float(lo if lo is not None else lo2)
    closed = op == ">=" or left == "["
    inside = low if closed else low + step
    ZeroConfig.model_validate(_config_with(key, key.name, int(inside) if kind == "int" else inside))
    below = low - step if closed else low
    with pytest.raises(ValidationError, match=re.escape(key.field)):
        ZeroConfig.model_validate(_config_with(key, key.name, int(below) if kind == "int" else below))
    if hi is not None:
        top = float(hi)
        above = top + step if right == "]" else top
        with pytest.raises(ValidationError, match=re.escape(key.field)):
            ZeroConfig.model_validate(_config_with(key, key.name, int(above) if kind == "int" else above))


STAGED = [k for k in KEYS if k.section == ("zero_optimization",) and k.stages != ALL_STAGES]


@pytest.mark.parametrize("key", STAGED, ids=lambda k: k.path)
def test_stages_column_matches_ignored_keys(key):
    value = {"device": "none"} if key.type.startswith("object") else _plain(key.default)
    for stage in ALL_STAGES:
        zero = {"stage": stage, key.name: value}
        if key.name == "zeropp_loco_param":  # qgZ's error feedback: needs qgZ at stage 3
            zero[key.name] = {}
            if stage == 3:
                zero["zero_quantized_gradients"] = True
        cfg = ZeroConfig.model_validate({"zero_optimization": zero})
        ignored = f"zero_optimization.{key.name}" in cfg.ignored_keys()
        without_effect = isinstance(key.status, Ignored) and key.status.reports(value)
        assert ignored is (stage not in key.stages or without_effect), (stage, key.stages)


def test_refused_keys_raise_with_the_reason_the_page_gives():
    page = render_markdown()
    rows = re.findall(
        r"^\| `([^`]+)` \| (.+) \|$",
        page.split("## Keys that are not accepted")[1].split("## DeepSpeed keys")[0],
        re.MULTILINE,
    )
    assert len(rows) >= 10
    types = re.findall(r"^\| `(\w+)\.type` \| `(\w+)` \| (.+) \|$", page.split("## Types")[1], re.MULTILINE)
    assert len(types) >= 3
    for section, kind, why in types:
        with pytest.raises(ValidationError, match=re.escape(why[:40])):
            ZeroConfig.model_validate({section: {"type": kind}})
    for path, why in rows:
        *section, key = path.split(".")
        cfg: dict[str, Any] = {}
        node = cfg
        for part in section:
            node = node.setdefault(part, {})
        node[key] = 1
        if section[:1] == ["optimizer"]:  # the first type whose params refuse the key
            kinds = OptimizerConfig.params_sections().items()
            cfg["optimizer"]["type"] = next(t[0] for c, t in kinds if key in c.rejected_keys())
        with pytest.raises(ValidationError) as info:
            ZeroConfig.model_validate(cfg)
        message = " ".join(str(info.value).split())
        assert path in message
        assert why.replace("\\|", "|")[:40] in message.replace("``", "`")


def test_sections_and_markdown_shape():
    sections = config_sections()
    titles = [s.title for s in sections]
    assert titles[0] == "Top level"
    assert "zero_optimization.offload_optimizer" in titles
    assert "optimizer.params (Adam / AdamW)" in titles and "optimizer.params (SGD)" in titles
    page = render_markdown(heading_level=3)
    assert page.startswith("### Top level")
    # every table row has the same number of cells as its header (escaped pipes do not split)
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            assert len(cells) in (2, 3, 5), line


DECLARED = [k for k in KEYS if isinstance(k.status, Ignored | Refused)]


def _other_value(default: Any, avoid: Any) -> Any:
    """A value of the key's type other than ``avoid`` (the default when there is nothing to avoid)."""
    if avoid is None:
        return default
    if isinstance(avoid, bool):
        return not avoid
    return 1000 if avoid != 1000 else 2


@pytest.mark.parametrize("key", DECLARED, ids=lambda k: k.path)
def test_ignored_and_refused_keys_are_reported_as_the_page_says(key):
    status = key.status
    avoid = status.behaves_as if isinstance(status, Ignored) else status.supported
    data = _config_with(key, key.name, _other_value(_plain(key.default), avoid))
    data.setdefault("zero_optimization", {})["stage"] = max(key.stages)
    if key.section == ("fp16",):
        data["fp16"]["enabled"] = True
    cfg = ZeroConfig.model_validate(data)
    assert status.reason in key.description
    if isinstance(status, Ignored):
        assert key.path in cfg.ignored_keys() and "No effect in zero" in key.description
        assert cfg.unsupported_features() == []
    else:
        (line,) = cfg.unsupported_features()
        assert line.startswith(f"{key.path} = ") and status.reason in line
        assert "Not implemented yet" in key.description
    assert len(DECLARED) >= 14  # zero_quantized_nontrainable_weights became IMPLEMENTED


def test_plain_types_read_as_json_values_not_python_annotations():
    page = render_markdown()
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(mode|api_key|group)` \| ([^|]+(?:\\\|[^|]+)*) \|", page, re.M)
    }
    assert rows["mode"] == '`"get"` \\| `"create"` \\| `"get_or_create"` or null'
    assert rows["api_key"].startswith("str (secret") and rows["group"] == "str or null"
    assert "Optional" not in page and "typing." not in page and "pydantic." not in page
