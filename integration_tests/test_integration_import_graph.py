"""The shape of the source tree: no import circles, imports point down, files a reader can hold.

The import graph is grimp's (the graph import-linter checks), built over every package of the
tree with every import it holds: module-level, inside functions and under ``TYPE_CHECKING``.

* no circle: no set of modules that import each other, directly or through others;
* no upward arrow: for each ``layers`` contract of ``pyproject.toml`` (the packages of DESIGN.md's
  stack, zero-full's sub-packages) no module imports a higher layer, nor a sibling of an
  independent layer (``"a | b"``);
* no exemption: no import-linter contract ignores an import;
* no source file over :data:`MAX_LINES` lines (``packages/*/src``, ``kernels/src``);
* docstrings at most :data:`MAX_DOCSTRING_SHARE` of the source's non-blank lines: they say what
  and why; measurements live in ``docs/`` and ``benchmarks/results/``;
* the tree speaks of the product only: no tracked file names a work session, an issue number or
  a person's role (history lives in git).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 800
MAX_DOCSTRING_SHARE = 0.20
# Written so that this line does not match itself.
HISTORY_WORDS = re.compile(r"sessio[n] [0-9]|issu[e] [0-9]|th[e] lead", re.IGNORECASE)

IMPORT_LINTER = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES: list[str] = IMPORT_LINTER["root_packages"]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _imports(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Each module of the tree -> the modules of the tree it imports directly."""
    modules = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def import_circles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))
    return circles


def _layer_of(module: str, layers: list[list[str]]) -> tuple[int, str] | None:
    """``(layer index, layer member)`` of the module (``None``: in no layer)."""
    for i, members in enumerate(layers):
        for member in members:
            if module == member or module.startswith(member + "."):
                return i, member
    return None


def upward_arrows(imports: Mapping[str, Iterable[str]], contract: Mapping) -> list[str]:
    """``"importer -> imported"`` for every import against a ``layers`` contract's order."""
    containers = contract.get("containers") or [""]
    bad = []
    for container in containers:
        prefix = f"{container}." if container else ""
        layers = [[prefix + m.strip() for m in layer.split("|")] for layer in contract["layers"]]
        for importer, imported in imports.items():
            here = _layer_of(importer, layers)
            if here is None:
                continue
            for target in imported:
                there = _layer_of(target, layers)
                if there is None:
                    continue
                upward = there[0] < here[0]
                sibling = there[0] == here[0] and there[1] != here[1]
                if upward or sibling:
                    bad.append(f"{importer} -> {target}")
    return sorted(bad)


def test_no_import_circles(graph: grimp.ImportGraph) -> None:
    circles = import_circles(_imports(graph))
    assert circles == [], "modules importing each other (break each circle):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_finder_finds_circles() -> None:
    imports = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_circles(imports) == [["a", "b", "c"]]


def test_no_upward_imports(graph: grimp.ImportGraph) -> None:
    contracts = [c for c in IMPORT_LINTER["contracts"] if c["type"] == "layers"]
    assert contracts, "pyproject.toml declares no layers contract"
    imports = _imports(graph)
    bad = {c["name"]: upward_arrows(imports, c) for c in contracts}
    assert all(not b for b in bad.values()), "\n".join(
        f"{name}:\n  " + "\n  ".join(b) for name, b in bad.items() if b
    )


def test_the_layer_check_finds_upward_and_sibling_imports() -> None:
    contract = {"containers": ["p"], "layers": ["top", "a | b", "low"]}
    imports = {"p.low.x": {"p.a"}, "p.a": {"p.b.y", "p.low.x"}, "p.top": {"p.a", "p.low.x"}}
    assert upward_arrows(imports, contract) == ["p.a -> p.b.y", "p.low.x -> p.a"]


def test_no_import_rule_exemptions() -> None:
    exempt = [
        f"{c['name']}: {key} = {c[key]}" for c in IMPORT_LINTER["contracts"] for key in c if "ignore" in key
    ]
    assert exempt == [], "import-linter contracts with exemptions (fix the import instead):\n" + "\n".join(
        exempt
    )


def _source_files() -> list[Path]:
    return sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("kernels/src/**/*.py")])


def test_no_source_file_over_the_limit() -> None:
    files = _source_files()
    assert len(files) > 100, f"found only {len(files)} source files under {ROOT}"
    long = {f.relative_to(ROOT): len(f.read_text().splitlines()) for f in files}
    over = {f: n for f, n in long.items() if n > MAX_LINES}
    assert over == {}, f"source files over {MAX_LINES} lines (split them):\n" + "\n".join(
        f"  {f}: {n} lines" for f, n in sorted(over.items())
    )


def _docstring_lines(source: str) -> int:
    """Non-blank lines of the module's, classes' and functions' docstrings in ``source``."""
    lines = source.splitlines()
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    count += sum(1 for line in lines[first.lineno - 1 : first.end_lineno] if line.strip())
    return count


def test_docstrings_are_at_most_a_fifth_of_the_source() -> None:
    sources = [f.read_text() for f in _source_files()]
    code = sum(1 for s in sources for line in s.splitlines() if line.strip())
    share = sum(map(_docstring_lines, sources)) / code
    assert share <= MAX_DOCSTRING_SHARE, f"docstrings are {share:.1%} of the non-blank source lines"


def test_the_docstring_count_sees_every_kind_of_docstring() -> None:
    source = (
        '"""Module."""\n\n\nclass A:\n    """Class,\n\n    two lines."""\n\n'
        '    def f(self):\n        """F."""\n        x = "not a docstring"\n'
    )
    assert _docstring_lines(source) == 4


_NOT_SOURCE = {"__pycache__", "site", "build", "dist"}


def _tracked_files() -> list[Path]:
    """The files git tracks; outside a git checkout, every file but hidden folders (``.git``,
    ``.nox``, venvs) and build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60)
    if listed.returncode == 0:
        return [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    return [
        f
        for f in ROOT.rglob("*")
        if f.is_file()
        and not any(
            part.startswith(".") or part in _NOT_SOURCE or part.endswith(".egg-info")
            for part in f.relative_to(ROOT).parts[:-1]
        )
    ]


def test_the_tree_speaks_of_the_product_only() -> None:
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):  # images, fonts; deleted in the work tree
            continue
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in HISTORY_WORDS.finditer(text)]
    assert found == [], "history words in the tree (they belong in git):\n" + "\n".join(found[:20])


def test_the_history_pattern_finds_history_words() -> None:
    words = ["Sessio" + "n 3", "issu" + "e 1", "Th" + "e Lead"]  # split: this file must not match
    text = f"{words[0]}0, {words[1]}9 and {words[2]}er"
    assert [m.group(0) for m in HISTORY_WORDS.finditer(text)] == words
