"""The shape of the source tree: no import circles, imports point down, files a reader can hold.

The import graph is grimp's (the graph import-linter checks), built over every package of the
tree with every import it holds: module-level, inside functions and under ``TYPE_CHECKING``.

* no circle: no set of modules that import each other, directly or through others;
* no upward arrow: for each ``layers`` contract of ``pyproject.toml`` (the packages of DESIGN.md's
  stack, zero-full's sub-packages) no module imports a higher layer, nor a sibling of an
  independent layer (``"a | b"``);
* no exemption: no import-linter contract ignores an import;
* no source file over :data:`MAX_LINES` lines (``packages/*/src``, ``kernels/src``).
"""

from __future__ import annotations

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
