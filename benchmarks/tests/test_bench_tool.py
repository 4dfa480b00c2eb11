"""``python -m benchmarks``: the registry, the shared command line, the report and the docs updater."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import __main__ as cli_main
from benchmarks.kit.cli import benchmark_parser
from benchmarks.kit.docs import DocsBlock, update_docs
from benchmarks.kit.report import Report
from benchmarks.registry import BENCHMARKS, find, load

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"


def test_every_benchmark_module_is_registered_once_and_no_benchmark_imports_another():
    modules = {p.stem for p in BENCH_DIR.glob("*.py")} - {"__init__", "__main__", "registry"}
    names = [b.name for b in BENCHMARKS]
    assert len(names) == len(set(names))
    assert {b.module for b in BENCHMARKS} == modules
    for path in BENCH_DIR.glob("*.py"):
        text = path.read_text()
        for other in modules - {path.stem}:
            assert f"from benchmarks.{other} import" not in text, f"{path.name} imports {other}"
            assert f"from benchmarks import {other}" not in text, f"{path.name} imports {other}"


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda b: b.name)
def test_every_registered_benchmark_parses_help_and_quick(bench, capsys):
    module = load(bench.name)
    parser = module.build_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--help"])
    assert stop.value.code == 0
    assert f"python -m benchmarks {bench.name}" in capsys.readouterr().out
    args = parser.parse_args(["--quick", "--out", "/tmp/x"])
    assert args.quick and str(args.out) == "/tmp/x"
    for dest, value in parser.quick.items():
        assert getattr(args, dest) == value, (bench.name, dest)
    assert hasattr(args, "docs") == any(run.docs for run in bench.runs)
    for run in bench.runs:  # the runs nox makes of it parse too
        parser.parse_args([*run.args, "--out", "/tmp/x"])


def test_quick_sets_defaults_that_explicit_options_override():
    parser = benchmark_parser(
        "demo", "Demo.\n\nMore.", quick={"repeats": 2, "numel": 5}, repeats=10, numel=100
    )
    assert (parser.parse_args([]).repeats, parser.parse_args([]).numel) == (10, 100)
    args = parser.parse_args(["--quick", "--repeats", "7"])
    assert (args.repeats, args.numel) == (7, 5)
    assert parser.parse_args([]).repeats == 10  # the quick defaults do not stay behind
    bad = benchmark_parser("demo", "Demo.", quick={"nothing": 1})
    with pytest.raises(ValueError, match="quick settings name no option"):
        bad.parse_args(["--quick"])


def test_the_cli_lists_the_registry_and_refuses_an_unknown_name(capsys):
    assert cli_main.main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [b.name for b in BENCHMARKS]
    assert cli_main.main(["nonesuch"]) == 2
    assert "no benchmark 'nonesuch'" in capsys.readouterr().err
    with pytest.raises(KeyError, match="choose from comm"):
        find("nonesuch")


def test_python_m_benchmarks_list_runs_from_the_repository_root():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "list"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.split()[0] == BENCHMARKS[0].name and "memory" in out


def _plot(result, out, stem):
    path = out / f"{stem}.png"
    path.write_bytes(b"png:" + json.dumps(result["rows"]).encode())
    return [path]


def test_the_report_writes_json_markdown_plot_and_its_docs_block(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "benchmarks.md"
    page.write_text("# Page\n\nbefore\n<!-- demo:begin -->\nold table\n<!-- demo:end -->\nafter\n")
    report = Report(
        "demo",
        {"rows": [1, 2]},
        "# Demo\n\n| a |\n|---|",
        "python -m benchmarks demo --quick",
        _plot,
        DocsBlock("benchmarks.md", "demo"),
    )
    paths = report.write(tmp_path / "out", docs)
    assert [p.name for p in paths] == ["demo.json", "demo.md", "demo.png", "benchmarks.md"]
    assert json.loads((tmp_path / "out/demo.json").read_text()) == {
        "rows": [1, 2],
        "command": "python -m benchmarks demo --quick",
    }
    md = (tmp_path / "out/demo.md").read_text()
    assert md.startswith("# Demo\n\n| a |") and md.endswith("Command: `python -m benchmarks demo --quick`\n")
    assert (tmp_path / "out/demo.png").read_bytes() == b"png:[1, 2]"
    assert (docs / "assets/benchmarks/demo.png").read_bytes() == b"png:[1, 2]"
    text = page.read_text()
    assert text.startswith(
        "# Page\n\nbefore\n<!-- demo:begin -->\n\n![demo](assets/benchmarks/demo.png)\n\n| a |"
    )
    assert "old table" not in text and "# Demo" not in text
    assert text.endswith("`python -m benchmarks demo --quick`\n\n<!-- demo:end -->\nafter\n")


def test_a_report_keeps_a_command_the_result_names_and_refuses_docs_without_a_block(tmp_path):
    report = Report("r", {"meta": {"command": "python -m benchmarks r"}}, None, "python -m benchmarks r")
    report.write(tmp_path)
    assert json.loads((tmp_path / "r.json").read_text()) == {"meta": {"command": "python -m benchmarks r"}}
    assert not (tmp_path / "r.md").exists()
    with pytest.raises(ValueError, match="no docs block"):
        report.write(tmp_path, tmp_path)


def test_the_docs_updater_replaces_only_its_block_and_names_a_missing_one(tmp_path):
    page = tmp_path / "memory.md"
    page.write_text("a\n<!-- x:begin -->\n1\n<!-- x:end -->\nb\n<!-- y:begin -->\n2\n<!-- y:end -->\nc\n")
    update_docs(tmp_path, DocsBlock("memory.md", "y"), "new")
    assert (
        page.read_text()
        == "a\n<!-- x:begin -->\n1\n<!-- x:end -->\nb\n<!-- y:begin -->\n\nnew\n\n<!-- y:end -->\nc\n"
    )
    with pytest.raises(RuntimeError, match="no <!-- z:begin --> ... <!-- z:end --> section"):
        update_docs(tmp_path, DocsBlock("memory.md", "z"), "new")
    with pytest.raises(RuntimeError, match="does not exist"):
        update_docs(tmp_path, DocsBlock("nowhere.md", "y"), "new")


def test_each_docs_block_a_benchmark_fills_is_in_the_docs():
    for bench in BENCHMARKS:
        block = getattr(load(bench.name), "BLOCK", None)
        if block is None:
            continue
        text = (ROOT / "docs" / block.page).read_text()
        assert text.find(block.begin) < text.find(block.end) and text.find(block.begin) >= 0, bench.name
