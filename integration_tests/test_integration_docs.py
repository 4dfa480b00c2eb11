"""Every code sample in the docs runs, and every JSON config in them validates (so docs cannot rot).

Conventions (also in CONTRIBUTING.md, "Docs"):

* a ```` ```python ```` block in ``docs/**/*.md`` or ``README.md`` is a complete program. If it
  calls ``init_process_group`` (or ``deepspeed.init_distributed()``) it is run with
  ``python -m torch.distributed.run --nproc-per-node 2 --standalone`` (gloo on CPU), otherwise
  with plain ``python``; each in a fresh temporary directory, with a timeout (identical blocks
  run once: the README repeats the getting-started script);
* the only python block that is not run is code of another library shown for comparison:
  its first line is exactly :data:`NOT_RUN_MARKER` and it imports deepspeed;
* other spellings of python (``py``, ``python3``, ``pycon``) are refused, so nothing slips
  past by its fence;
* a ```` ```json ```` block is a complete zero config: it must parse (no repeated keys) and
  pass ``ZeroConfig.model_validate``. JSON that is not a zero config (a manifest excerpt,
  with ``//`` elisions) goes in a ```` ```json5 ```` block, which is not checked;
* ```` ```bash ```` blocks are not run (the README's commands would recurse into nox).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zero_full import ZeroConfig

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN_MARKER = "# DeepSpeed (for comparison; not run)"
TIMEOUT_S = 300
REFUSED_LANGS = {"py", "py3", "python3", "pycon", "jsonc"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language and its code (dedented)."""

    path: Path
    line: int
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, including indented ones (content tabs, lists)."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening.group("indent"), opening.group("fence")
        lang = opening.group("info").split()[0].lstrip("{.").rstrip("}") if opening.group("info") else ""
        body = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        else:
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: code fence {fence} is never closed")
        blocks.append(Block(path, i + 1, lang.lower(), textwrap.dedent("\n".join(body)) + "\n"))
        i = j + 1
    return blocks


def doc_files() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


ALL_BLOCKS = [b for f in doc_files() for b in fenced_blocks(f)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
JSON = [b for b in ALL_BLOCKS if b.lang == "json"]


def _is_comparison(block: Block) -> bool:
    return block.code.splitlines()[0].strip() == NOT_RUN_MARKER


def _id(block: Block) -> str:
    return block.where


def test_the_docs_have_samples_and_follow_the_fence_conventions():
    assert len(PYTHON) >= 8 and len(JSON) >= 2, "the docs lost their code samples"
    refused = [f"{b.where}: ```{b.lang}" for b in ALL_BLOCKS if b.lang in REFUSED_LANGS]
    assert not refused, (
        f"use ```python for code (it is run) and ```json5 for JSON that is not a zero config: {refused}"
    )
    for block in PYTHON:
        if NOT_RUN_MARKER in block.code and not _is_comparison(block):
            raise AssertionError(f"{block.where}: {NOT_RUN_MARKER!r} must be the block's first line")
        if _is_comparison(block):
            assert re.search(r"^import deepspeed", block.code, re.MULTILINE), (
                f"{block.where}: only DeepSpeed code shown for comparison may skip running; "
                "this block does not import deepspeed"
            )


def _command(block: Block, script: Path) -> list[str]:
    if "init_process_group" in block.code or "init_distributed()" in block.code:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
        return [*launcher, str(script)]
    return [sys.executable, str(script)]


def _to_run() -> list[Block]:
    """The python blocks to run; identical blocks (README repeats getting-started) run once."""
    unique: dict[str, Block] = {}
    for block in PYTHON:
        if not _is_comparison(block):
            unique.setdefault(block.code, block)
    return list(unique.values())


@pytest.mark.parametrize("block", _to_run(), ids=_id)
def test_python_sample_runs(block: Block, tmp_path: Path):
    script = tmp_path / f"{block.path.stem.replace('-', '_')}_line{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(
            _command(block, script),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.where}: the code sample did not finish within {TIMEOUT_S} s\n{exc.stdout or ''}")
    if proc.returncode != 0:
        pytest.fail(f"{block.where}: the code sample exited with {proc.returncode}:\n{_excerpt(proc)}")


def _excerpt(proc: subprocess.CompletedProcess[str]) -> str:
    """The first traceback of the output (a rank's, under torchrun) and the last lines."""
    lines = (proc.stdout + proc.stderr).splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(len(lines) - 40, 0))
    shown = lines[first : first + 50]
    rest = lines[max(first + 50, len(lines) - 5) :]
    return "\n".join(shown + (["..."] if rest else []) + rest)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"keys repeated in one object: {repeated}")
    return dict(pairs)


@pytest.mark.parametrize("block", JSON, ids=_id)
def test_json_sample_is_a_valid_zero_config(block: Block):
    try:
        data = json.loads(block.code, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        pytest.fail(f"{block.where}: not valid JSON ({exc}); use ```json5 for JSON that is not a zero config")
    assert isinstance(data, dict), f"{block.where}: a zero config is a JSON object"
    try:
        ZeroConfig.model_validate(data)
    except ValueError as exc:
        pytest.fail(f"{block.where}: ZeroConfig rejects this config:\n{exc}")


def _load_hook():
    path = ROOT / "docs/hooks/config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference_hook", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_as_built_lists_every_accepted_key():
    hook = _load_hook()
    source = (ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    assert hook.MARKER in source, "docs/configuration.md lost the generated reference's marker"
    assert "docs/hooks/config_reference.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    page = hook.on_page_markdown(source, page=None)
    assert hook.MARKER not in page

    def accepted(cls, path):
        keys = [(path, k) for k in cls.accepted_keys()]
        for name, info in cls.model_fields.items():
            for sub in _sections(cls, name, info.annotation):
                keys += accepted(sub, (*path, cls.documented_key(name)))
        return keys

    missing = [".".join((*p, k)) for p, k in accepted(ZeroConfig, ()) if f"`{k}`" not in page]
    assert not missing, f"keys ZeroConfig accepts that the built configuration page lacks: {missing}"


def _sections(cls, name, annotation):
    from zero_full.config.base import Section, TypedSection

    if issubclass(cls, TypedSection) and name == "params":
        return list(cls.params_sections())
    args = (annotation, *getattr(annotation, "__args__", ()))
    return [a for a in args if isinstance(a, type) and issubclass(a, Section)]


def test_the_benchmarks_page_reads_in_five_minutes_and_quotes_results_files():
    """docs/benchmarks.md stays short (the detail lives in the results files), and every results
    file it quotes figures from (outside its index of benchmarks) exists and names its command."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 300, "docs/benchmarks.md is over 300 lines: move detail to results files"
    text = "\n".join(line for line in page.splitlines() if not line.startswith("| `"))  # not the index
    quoted = sorted(set(re.findall(r"`(?:benchmarks/results/)?([a-z0-9_]+\.md)`", text)))
    assert len(quoted) >= 5, f"the page quotes too few results files: {quoted}"
    results = ROOT / "benchmarks" / "results"
    for name in quoted:
        assert (results / name).exists(), f"docs/benchmarks.md quotes benchmarks/results/{name}: missing"
        assert re.search(r"python (-m benchmarks|benchmarks/)", (results / name).read_text()), (
            f"benchmarks/results/{name} does not name the command that wrote it"
        )
