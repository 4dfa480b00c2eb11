"""Smoke test of an installation from wheels (run by ``nox -s wheels``; standard library only).

``python wheel_smoke.py zero-full --readme README.md --source <checkout>``, in a venv where
``pip install --find-links dist zero-full`` (or ``zero-comm``) was run:

* zero-full: every zero package imports from site-packages (not from the checkout), ``zero
  report``, README's ``train.py`` (the python block of its "Use" section, extracted here so the
  README and this test cannot drift) under ``torch.distributed.run`` on 2 ranks, then ``zero
  consolidate`` of its checkpoint;
* zero-comm: it imports from site-packages, only zero-launch (its demo's launcher) was installed
  with it, and
  ``python -m zero_comm.demo --world 2`` passes.

Every command runs in a fresh temporary directory and must exit 0 with nothing that looks like a
warning on stdout or stderr. Exits 1 naming the first failed check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT_S = 600
# Python's warnings ("UserWarning: ...", "FutureWarning"), logging's "WARNING", torch's C++ "W1123 ..." lines.
_WARNING = re.compile(r"warn|^W\d{4} ", re.IGNORECASE | re.MULTILINE)


class SmokeFailure(RuntimeError):
    """A smoke check failed; the message names it."""


def readme_train_script(readme: Path) -> str:
    """The python block of README's ``## Use`` section (the one ``train.py``)."""
    text = readme.read_text(encoding="utf-8")
    match = re.search(r"^## Use\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise SmokeFailure(f"{readme}: no '## Use' section")
    blocks = re.findall(r"^```python\n(.*?)^```\s*$", match.group(1), re.MULTILINE | re.DOTALL)
    if len(blocks) != 1:
        raise SmokeFailure(
            f"{readme}: the 'Use' section has {len(blocks)} python blocks, expected 1 (train.py)"
        )
    return blocks[0]


def run(args: list[str], cwd: Path) -> str:
    """Run ``args`` in ``cwd``; raise unless it exits 0 without a warning. Returns its stdout."""
    shown = " ".join(a if a != sys.executable else "python" for a in args)
    print(f"$ {shown}", flush=True)
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    sys.stdout.write(proc.stdout)
    sys.stdout.write(proc.stderr)
    if proc.returncode != 0:
        raise SmokeFailure(f"{shown} exited with {proc.returncode}")
    for stream, text in (("stderr", proc.stderr), ("stdout", proc.stdout)):
        found = _WARNING.search(text)
        if found is not None:
            line = text[text.rfind("\n", 0, found.start()) + 1 :].split("\n", 1)[0]
            raise SmokeFailure(f"{shown} printed a warning on {stream}: {line}")
    return proc.stdout


def check_installed(wanted: tuple[str, ...], source: Path) -> None:
    """Exactly the ``wanted`` zero distributions are installed, imported from outside ``source``."""
    names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    installed = sorted({name for name in names if name.startswith("zero-")})
    if installed != sorted(wanted):
        raise SmokeFailure(f"installed zero distributions {installed}, expected exactly {list(wanted)}")
    for dist in wanted:
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        trees = [source.resolve() / "packages", source.resolve() / "kernels"]  # the checkout's sources
        if origin is None or any(t in origin.parents for t in trees) or "site-packages" not in origin.parts:
            raise SmokeFailure(
                f"{dist} is imported from {origin}, not from an installed wheel in site-packages"
            )
        if not (origin.parent / "py.typed").is_file():
            raise SmokeFailure(f"{dist}: the wheel has no py.typed next to {origin}")
        print(f"{dist} {importlib.metadata.version(dist)}: {origin.parent}", flush=True)


def smoke_full(readme: Path, source: Path, work: Path) -> None:
    from zero_full.cli.doctor import ZERO_DISTRIBUTIONS  # every product package, as zero report lists them

    check_installed(ZERO_DISTRIBUTIONS, source)
    imports = "; ".join(f"import {d.replace('-', '_')}" for d in ZERO_DISTRIBUTIONS)
    run([sys.executable, "-c", imports], work)
    run(["zero", "report", "--timeout", "180"], work)  # its gloo check spawns 2 processes: slow when loaded
    (work / "train.py").write_text(readme_train_script(readme), encoding="utf-8")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    run([*torchrun, "train.py"], work)
    out = run(["zero", "consolidate", "checkpoints", "model.safetensors"], work)
    if not (work / "model.safetensors").is_file() or "wrote" not in out:
        raise SmokeFailure("zero consolidate did not write model.safetensors")


def smoke_comm(source: Path, work: Path) -> None:
    check_installed(("zero-launch", "zero-comm"), source)
    run([sys.executable, "-c", "import zero_comm; print(zero_comm.__doc__.splitlines()[0])"], work)
    run([sys.executable, "-m", "zero_comm.demo", "--world", "2"], work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", choices=["zero-full", "zero-comm"])
    parser.add_argument("--readme", type=Path, required=True, help="the README whose train.py is run")
    parser.add_argument("--source", type=Path, required=True, help="the checkout (must not be imported)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zero-wheel-smoke-") as tmp:
        try:
            if args.dist == "zero-full":
                smoke_full(args.readme, args.source, Path(tmp))
            else:
                smoke_comm(args.source, Path(tmp))
        except (SmokeFailure, subprocess.TimeoutExpired) as exc:
            print(f"wheel smoke test of {args.dist} FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"wheel smoke test of {args.dist}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
