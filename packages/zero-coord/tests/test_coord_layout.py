"""The package's layout: no import cycle, hooks see the coordinator only through a protocol,
and nothing outside the trace reads the trace's private fields."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import zero_coord
from zero_coord import Coordinator, Trace
from zero_coord.hooks import HookTarget

SRC = Path(zero_coord.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(SRC.glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """Every ``zero_coord.<module>`` this module imports, under ``TYPE_CHECKING`` too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_coord."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("zero_coord."))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``None``: acyclic)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_no_import_cycle_inside_the_package():
    graph = {name: _imports(tree) for name, tree in _modules().items() if name != "__init__"}
    assert "coordinator" not in graph["hooks"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_coordinator_satisfies_the_hook_protocol():
    members = [name for name in vars(HookTarget) if not name.startswith("_")]
    assert {"paused", "on_pre_forward", "on_post_forward", "on_grad_accumulated"} <= set(members)
    for name in members:
        declared = inspect.getattr_static(HookTarget, name)
        actual = inspect.getattr_static(Coordinator, name)
        if isinstance(declared, property):
            assert isinstance(actual, property), name
            continue
        wanted = list(inspect.signature(declared).parameters)
        assert list(inspect.signature(actual).parameters) == wanted, name


def test_only_the_trace_reads_its_private_fields():
    private = {name for name in Trace.__slots__ if name.startswith("_")}
    readers = {
        f"{name}.py:{node.lineno} .{node.attr}"
        for name, tree in _modules().items()
        if name != "trace"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in private
    }
    assert private and not readers, sorted(readers)
