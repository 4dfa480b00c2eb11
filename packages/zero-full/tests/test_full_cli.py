"""The ``zero`` CLI: ``zero estimate`` against the ZeRO formulas, ``zero report`` with its gloo check."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import sysconfig
from fractions import Fraction

import pytest

from zero_comm.units import format_bytes
from zero_full.cli.doctor import gloo_smoke_check
from zero_full.cli.main import main
from zero_full.memory.estimate import EstimatePrecision, estimate_model_states, parse_count


def formula_bytes(psi: int, n: int, precision: str) -> dict[int, float]:
    """Per-rank model-state bytes of the ZeRO paper (Rajbhandari et al., 2020, section 5), written out
    independently: ``psi`` parameters, ``n`` ranks; fp32 training keeps 4 bytes each of parameters and
    gradients and 8 of Adam state, mixed precision 2 + 2 and 12 (fp32 master copy, momentum, variance).
    Stage 1 partitions the optimizer state, stage 2 the gradients too, stage 3 everything."""
    if precision == "mixed":
        return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def table_rows(text: str) -> dict[str, list[str]]:
    """``{stage name: cells}`` of the estimate table (cells split on runs of 2+ spaces)."""
    import re

    rows = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3") or cells[0].startswith("MiCS shard "):
            rows[cells[0]] = cells
    return rows


# ----------------------------------------------------------------------------- estimate


def test_estimate_without_arguments_prints_the_paper_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "estimate")
    assert code == 0
    rows = table_rows(out)
    totals = {name: cells[-1] for name, cells in rows.items()}
    assert totals == {"DDP": "120.0 GB", "ZeRO-1": "31.4 GB", "ZeRO-2": "16.6 GB", "ZeRO-3": "1.9 GB"}
    assert "7.5B (7,500,000,000)" in out and "ranks (N)       64" in out
    # columns are aligned: every table line has the same width up to the total column
    lines = [
        line
        for line in out.splitlines()
        if line.split(" ")[0] in ("stage", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    ]
    assert len({len(line) for line in lines}) == 1


def test_estimate_one_stage_fp32(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(
        capsys, "estimate", "--params", "125M", "--world", "8", "--stage", "2", "--precision", "fp32"
    )
    assert code == 0
    rows = table_rows(out)
    assert list(rows) == ["ZeRO-2"]
    # fp32 stage 2: params 4P, grads 4P/N, Adam moments 8P/N = 500 MB + 62.5 MB + 125 MB
    assert rows["ZeRO-2"][1:] == ["4P + 12P/N", "500.0 MB", "62.5 MB", "125.0 MB", "687.5 MB"]


@pytest.mark.parametrize(
    ("params", "psi"),
    [
        ("1", 1),
        ("7", 7),
        ("1023", 1023),
        ("125M", 125_000_000),
        ("1.3B", 1_300_000_000),
        ("7.5b", 7_500_000_000),
    ],
)
@pytest.mark.parametrize("world", [1, 2, 4, 7, 64])
@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_estimate_json_matches_formulas(
    capsys: pytest.CaptureFixture[str], params: str, psi: int, world: int, precision: str
) -> None:
    code, out = run(
        capsys, "estimate", "--params", params, "--world", str(world), "--precision", precision, "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert (data["num_params"], data["world_size"], data["precision"]) == (psi, world, precision)
    expected = formula_bytes(psi, world, precision)
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    for s in data["stages"]:
        assert s["total_bytes"] == pytest.approx(expected[s["stage"]], rel=1e-12)
        assert s["params_bytes"] + s["gradients_bytes"] + s["optimizer_bytes"] == pytest.approx(
            s["total_bytes"]
        )
        assert s["total_gb"] == pytest.approx(expected[s["stage"]] / 1e9, rel=1e-12)


def test_world_of_one_makes_every_stage_equal_to_ddp() -> None:
    est = estimate_model_states(1023, 1)
    assert {s.total_bytes for s in est.stages} == {16 * 1023}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7.5B", 7_500_000_000),
        ("125M", 125_000_000),
        ("125m", 125_000_000),
        ("350k", 350_000),
        ("1e9", 1_000_000_000),
        ("2.5e3", 2500),
        ("1T", 10**12),
        ("1.3G", 1_300_000_000),
        ("1_000_003", 1_000_003),
        (" 42 ", 42),
    ],
)
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["abc", "7.5X", "1.5", "0", "-3", "1e-3", "", "B"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_count(text)


def test_bad_arguments_exit_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["estimate", "--params", "lots"],
        ["estimate", "--world", "0"],
        ["estimate", "--stage", "4"],
        [],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "cannot read 'lots' as a count" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "estimate" in out and "report" in out


def _installed_script() -> pathlib.Path:
    """The ``zero`` console script of the running interpreter's environment."""
    name = "zero.exe" if sys.platform == "win32" else "zero"
    for folder in (pathlib.Path(sys.executable).parent, pathlib.Path(sysconfig.get_path("scripts"))):
        if (folder / name).exists():
            return folder / name
    raise AssertionError(f"the `zero` entry point is not installed next to {sys.executable}")


def test_installed_zero_entry_point_runs() -> None:
    proc = subprocess.run(
        [str(_installed_script()), "estimate"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    totals = {name: cells[-1] for name, cells in table_rows(proc.stdout).items()}
    assert totals == {"DDP": "120.0 GB", "ZeRO-1": "31.4 GB", "ZeRO-2": "16.6 GB", "ZeRO-3": "1.9 GB"}


# ----------------------------------------------------------------------------- report


def test_report_runs_and_gloo_smoke_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    code, out = run(capsys, "report")
    assert code == 0, out
    lines = {line.split("  ")[1].strip(): line for line in out.splitlines()[1:]}
    assert torch.__version__ in lines["torch"]
    assert "gloo yes" in lines["backends"]
    assert "not installed" not in lines["zero-full"]
    smoke = next(line for line in out.splitlines() if "gloo smoke check" in line)
    assert "  OK in " in smoke and "3 on every rank" in smoke


def test_report_json_without_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "report", "--json", "--no-smoke")
    assert code == 0
    data = json.loads(out)
    assert data["smoke"] is None and data["backends"]["gloo"] is True
    # every product package: the zero distributions installed with zero-full, less the internal fixtures
    installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert set(data["packages"]) == {n for n in installed if n.startswith("zero-")} - {"zero-testing"}
    assert data["accelerator"] in (None, "cuda", "xpu", "mps", "hpu", "mtia")


def test_smoke_check_reports_a_timeout_instead_of_hanging() -> None:
    result = gloo_smoke_check(timeout=0.01)  # far too short to even start the processes
    assert not result.ok
    assert "did not finish within 0.01 s (killed)" in result.detail


# ----------------------------------------------------------------------------- estimate, MiCS


@pytest.mark.parametrize(("precision", "world", "shard"), [("mixed", 64, 8), ("fp32", 6, 3), ("fp32", 4, 4)])
def test_estimate_mics_row_is_stage3_over_the_shard_group(precision: str, world: int, shard: int) -> None:
    psi = 1_000_003
    est = estimate_model_states(psi, world, precision, mics_shard_size=shard)
    mics = est.stages[-1]
    assert (mics.stage, mics.shard_size, mics.name) == (3, shard, f"MiCS shard {shard}")
    assert mics.total_bytes == pytest.approx(16 * psi / shard, rel=1e-12)
    # MiCS over the whole world is plain ZeRO-3; over fewer ranks it holds more.
    zero3 = next(s for s in est.stages if s.stage == 3 and s.shard_size is None)
    assert mics.total_bytes == pytest.approx(zero3.total_bytes * world / shard, rel=1e-12)


def test_estimate_cli_mics_row_and_bad_shard(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "estimate", "--params", "7.5B", "--world", "64", "--mics-shard-size", "8")
    assert code == 0
    rows = table_rows(out)
    assert rows["MiCS shard 8"][1] == "16P/S"
    assert rows["MiCS shard 8"][-1] == format_bytes(16 * 7.5e9 / 8)
    code = main(["estimate", "--world", "6", "--mics-shard-size", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "mics_shard_size=4 does not divide world size 6" in err


def test_report_names_a_missing_requirement_and_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    real = importlib.metadata.requires

    def requires(name: str) -> list[str] | None:
        extra = (
            ["zero-no-such-dist>=1", 'zero-no-such-extra>=1; extra == "demo"'] if name == "zero-full" else []
        )
        return [*(real(name) or []), *extra]

    monkeypatch.setattr(importlib.metadata, "requires", requires)
    code, out = run(capsys, "report", "--no-smoke")
    assert code == 1
    assert "MISSING" in out and "zero-full needs zero-no-such-dist>=1: pip install the package" in out
    assert "zero-no-such-extra" not in out  # an extra's requirement is optional
    data = json.loads(run(capsys, "report", "--json", "--no-smoke")[1])
    assert data["missing"] == ["zero-full needs zero-no-such-dist>=1"]


def _evaluate(formula: str, psi: int, world: int) -> Fraction:
    """A formula such as ``"4P + 12P/N"``, evaluated exactly."""
    total = Fraction(0)
    for term in formula.split(" + "):
        coeff, _, divisor = term.partition("P")
        total += int(coeff) * Fraction(psi, world if divisor == "/N" else 1)
    return total


@pytest.mark.parametrize("precision", list(EstimatePrecision))
@pytest.mark.parametrize(("psi", "world"), [(1, 1), (7, 2), (1023, 4), (7_500_000_000, 64)])
def test_formula_text_is_what_the_estimator_computes(precision, psi, world):
    est = estimate_model_states(psi, world, precision)
    for s in est.stages:
        assert float(_evaluate(precision.formula(s.stage), psi, world)) == pytest.approx(
            s.total_bytes, rel=1e-12
        )
    with pytest.raises(ValueError, match="stage must be"):
        precision.formula(4)
