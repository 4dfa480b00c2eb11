"""Every import a package makes at run time is declared in its pyproject.toml (and nothing else is).

For each package, an AST scan of ``src/``:

* a module-level import (not under ``try`` / ``if TYPE_CHECKING``) must be a required dependency;
* an import inside a function, a ``try`` or an ``if`` may instead come from an optional extra (``test``
  does not count), and then the package's source must name the extra (``zero-full[demo]``) so
  the error a user sees says what to install;
* importing torch, or calling ``Tensor.numpy()``, needs ``numpy``: without it ``import torch``
  warns "Failed to initialize NumPy" and ``.numpy()`` raises "Numpy is not available";
* a required third-party dependency must be imported somewhere (numpy counts as imported by
  the rule above).

Standard-library names come from ``sys.stdlib_module_names``; import names are mapped to
distributions with ``importlib.metadata.packages_distributions()`` (the import name itself
when the distribution is not installed here, e.g. triton).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def nox_literal(name: str):
    """A literal constant of ``noxfile.py`` (read, not imported: nox need not be installed here)."""
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        names = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
        if names == [name]:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{ROOT / 'noxfile.py'} has no literal {name} = ...: declare it there")


def package_dirs() -> dict[str, str]:
    """Each package's folder, as ``noxfile.py`` declares them in ``PACKAGE_DIRS``, so a package CI
    tests is a package this test checks."""
    return nox_literal("PACKAGE_DIRS")


PACKAGE_DIRS = package_dirs()
NOT_EXTRAS = {"test"}  # extras for the package's own test suite, not for users


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(text: str) -> tuple[str, tuple[str, ...]]:
    """``"zero-kernels[triton]>=0.1"`` -> ``("zero-kernels", ("triton",))``."""
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", text)
    if match is None:
        raise ValueError(f"unparsable requirement {text!r}")
    extras = tuple(e.strip() for e in (match.group(2) or "").split(",") if e.strip())
    return normalize(match.group(1)), extras


def project(dist: str) -> dict:
    return tomllib.loads((ROOT / PACKAGE_DIRS[dist] / "pyproject.toml").read_text())["project"]


def extra_closure(dist: str, extra: str) -> set[str]:
    """Distributions an extra brings, following extras of zero packages (``zero-kernels[triton]``)."""
    names: set[str] = set()
    for req in project(dist).get("optional-dependencies", {}).get(extra, []):
        name, extras = requirement(req)
        names.add(name)
        for sub in extras:
            if name in PACKAGE_DIRS:
                names |= extra_closure(name, sub)
    return names


@dataclass
class Imports:
    """What a package's sources import: distribution -> files, split by how the import is made."""

    unconditional: dict[str, set[str]] = field(default_factory=dict)
    guarded: dict[str, set[str]] = field(default_factory=dict)
    numpy_needed: set[str] = field(default_factory=set)


def _dist_of(module: str, mapping: dict[str, list[str]]) -> str:
    top = module.split(".")[0]
    if top.replace("_", "-") in PACKAGE_DIRS:
        return top.replace("_", "-")
    dists = mapping.get(top)
    return normalize(dists[0]) if dists else normalize(top)


class _Scanner(ast.NodeVisitor):
    def __init__(self, name: str, found: Imports, mapping: dict[str, list[str]]) -> None:
        self.name, self.found, self.mapping, self.depth = name, found, mapping, 0

    def _guarded(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Try = _guarded

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            return  # never imported at run time
        self._guarded(node)  # e.g. ``if HAS_TRITON:``

    def _record(self, module: str) -> None:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names:
            return
        if top == "torch":
            self.found.numpy_needed.add(self.name)
        bucket = self.found.guarded if self.depth else self.found.unconditional
        bucket.setdefault(_dist_of(module, self.mapping), set()).add(self.name)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._record(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._record(node.module)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "numpy" and not node.args:
            self.found.numpy_needed.add(self.name)  # Tensor.numpy()
        self.generic_visit(node)


def scan(dist: str) -> tuple[Imports, str]:
    """The imports of ``dist``'s sources (its own package excluded) and their concatenated text."""
    found, mapping = Imports(), importlib.metadata.packages_distributions()
    src = ROOT / PACKAGE_DIRS[dist] / "src"
    texts = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        texts.append(text)
        _Scanner(str(path.relative_to(ROOT)), found, mapping).visit(ast.parse(text, str(path)))
    for bucket in (found.unconditional, found.guarded):
        bucket.pop(dist, None)
    return found, "\n".join(texts)


def problems(dist: str, found: Imports, source_text: str) -> list[str]:
    """Every mismatch between what ``dist`` imports and what its pyproject.toml declares."""
    meta = project(dist)
    required = {requirement(r)[0] for r in meta.get("dependencies", [])}
    extras = {e: extra_closure(dist, e) for e in meta.get("optional-dependencies", {}) if e not in NOT_EXTRAS}
    out = []
    for name, files in sorted(found.unconditional.items()):
        if name not in required:
            out.append(f"{dist}: {name} is imported at module level ({sorted(files)}) but not a dependency")
    for name, files in sorted(found.guarded.items()):
        if name in required:
            continue
        owners = sorted(e for e, names in extras.items() if name in names)
        if not owners:
            out.append(
                f"{dist}: {name} is imported ({sorted(files)}) but neither a dependency nor in an extra"
            )
        elif not any(f"{dist}[{e}]" in source_text for e in owners):
            out.append(
                f"{dist}: {name} comes with extra(s) {owners}, but no message names {dist}[{owners[0]}]"
            )
    if found.numpy_needed and "numpy" not in required:
        out.append(f"{dist}: numpy is needed by torch ({sorted(found.numpy_needed)}) but not a dependency")
    imported = set(found.unconditional) | set(found.guarded) | ({"numpy"} if found.numpy_needed else set())
    for name in sorted(required - imported - set(PACKAGE_DIRS)):
        out.append(f"{dist}: {name} is a dependency but nothing in src/ imports it")
    return out


@pytest.mark.parametrize("dist", list(PACKAGE_DIRS))
def test_declared_dependencies_match_imports(dist: str) -> None:
    found, text = scan(dist)
    assert problems(dist, found, text) == []


def test_the_scan_catches_an_undeclared_import_and_numpy() -> None:
    # made-up imports of zero-comm: reported as undeclared
    found, text = scan("zero-comm")
    found.unconditional["pydantic"] = {"x.py"}
    found.guarded["tqdm"] = {"y.py"}
    meta_problems = problems("zero-comm", found, text)
    assert any("pydantic is imported at module level" in p for p in meta_problems)
    assert any("tqdm is imported" in p and "neither a dependency nor in an extra" in p for p in meta_problems)
    assert found.numpy_needed, "zero-comm imports torch"


def test_tensor_numpy_call_and_torch_import_need_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    found = Imports()
    _Scanner("m.py", found, {}).visit(ast.parse("def f(t):\n    return t.numpy().tobytes()\n"))
    _Scanner("n.py", found, {}).visit(ast.parse("import torch\n"))
    assert found.numpy_needed == {"m.py", "n.py"}
    monkeypatch.setattr(sys.modules[__name__], "project", lambda dist: {"dependencies": ["torch>=2.13"]})
    assert problems("zero-kernels", found, "") == [
        "zero-kernels: numpy is needed by torch (['m.py', 'n.py']) but not a dependency"
    ]


def test_every_package_allows_the_torch_releases_the_smoke_set_runs_on() -> None:
    """One torch range in every package's metadata, from the oldest release ``torch_smoke`` runs on."""
    tested = nox_literal("TORCH_RANGE")
    oldest = tested["oldest"].removeprefix("torch==").split(".")
    newest = tested["newest"].removeprefix("torch==").split(".")
    expected = f"torch>={oldest[0]}.{oldest[1]},<3"
    assert newest[0] == "2", f"torch_smoke's newest release {tested['newest']} is outside {expected}"
    for dist in PACKAGE_DIRS:
        declared = [r for r in project(dist)["dependencies"] if requirement(r)[0] == "torch"]
        assert declared == [expected], f"{dist}: torch requirement {declared}, expected [{expected!r}]"


@pytest.mark.parametrize("dist", list(PACKAGE_DIRS))
def test_every_package_has_smoke_tests(dist: str) -> None:
    """``torch_smoke`` runs each package's ``-m smoke`` selection: none would fail it (no tests ran)."""
    tests = ROOT / PACKAGE_DIRS[dist] / "tests"
    assert any("pytest.mark.smoke" in f.read_text() for f in tests.glob("test_*.py")), dist
    config = (ROOT / PACKAGE_DIRS[dist] / "pyproject.toml").read_text()
    assert "smoke:" in config, f"{dist}: the smoke marker is not registered in its pytest config"
