"""Every workflow of the zero monorepo.

    nox -t ci                 everything CI runs (README's test command): the session ci, which
                              runs suite, torch_smoke, lint and wheels in lanes side by side
    nox -s suite              every package's unit tests, integration, docs and kernels, in one
                              venv that grows up the layer stack
    nox -s tests              unit tests, one session per package, each in its own venv
                              holding only that package, its declared dependencies and torch
    nox -s kernels            Triton kernels vs their torch twins under TRITON_INTERPRET=1
    nox -s integration        multi-process end-to-end trainings (gloo on CPU)
    nox -s torch_smoke        the smoke set on the oldest and the newest supported torch
    nox -s lint               ruff + import-linter layer contracts
    nox -s docs               mkdocs build --strict (prints where the site is); -- serve: serve it
    nox -s build              every package's wheel and sdist into dist/
    nox -s wheels             install zero-comm, then zero-full, by name from freshly built wheels, smoke test
    nox -s demo               the demo, zero train (README's demo command)
    nox -s bench              benchmarks, results under benchmarks/results/
    nox -s cluster-bench      step time and inter-node bytes on a simulated 2-node cluster (root)
    nox -s gpu                the GPU check (an accelerator; -- --dry-run: the same on CPU)

torch is pinned to 2.13.0 through constraints.txt (a CPU wheel; an unpinned torch
would pull a multi-GB CUDA build). Package metadata keeps a normal range. It is installed once
per checkout (.nox/_shared-torch) and every session's venv sees it (see ``_torch``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself may run on 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
PACKAGE_DIRS = {
    "zero-kernels": "kernels",
    "zero-launch": "packages/zero-launch",
    "zero-comm": "packages/zero-comm",
    "zero-offload": "packages/zero-offload",
    "zero-params": "packages/zero-params",
    "zero-coord": "packages/zero-coord",
    "zero-optim": "packages/zero-optim",
    "zero-full": "packages/zero-full",
    "zero-testing": "packages/zero-testing",
}
TORCH = "torch==2.13.0"
# Compiled bytecode of everything any session imports, kept across sessions under .nox (not beside
# the sources). Packages are installed without .pyc files (--no-compile) and a machine may set
# PYTHONDONTWRITEBYTECODE, in which case every process recompiled torch's modules at import:
# about 3 of the 5 CPU seconds an ``import torch`` took, in each rank each test starts. Here the
# first import of a module writes its bytecode and every later process, in any session, reads it.
BYTECODE_ENV = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(ROOT / ".nox" / "_pycache")}
# Ranks of multi-process tests share 2 cores: one thread each.
TEST_ENV = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **BYTECODE_ENV}

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


def _pip(session: nox.Session, *args: str) -> None:
    """``pip install`` into the session's venv, without compiling .pyc files up front.

    Byte-compiling torch's ~5,000 modules is 20 of the 37 s a torch install takes; Python compiles
    the modules a session imports when it first imports them, into :data:`BYTECODE_ENV`'s cache.
    """
    session.install("--no-compile", *args)


# torch (and its own dependencies) is installed once per checkout into this directory and every
# session's venv sees it through a .pth file: one ~0.8 GB install instead of one per session.
SHARED_TORCH = ROOT / ".nox" / "_shared-torch"


def _torch(session: nox.Session) -> None:
    """Make the pinned torch importable in the session's venv without installing it there again.

    The first session installs ``TORCH`` with ``pip install --target`` into :data:`SHARED_TORCH`
    (with a marker naming the pin and the Python version; a different one starts it afresh); each
    session's venv gets a ``.pth`` file that appends that directory to ``sys.path``, so pip in the
    venv sees torch as installed and the ranks a test spawns import it too. Installing ~5,000
    files was 30-50 s of each venv that holds torch. What a session installs itself
    still lands in its own venv (and wins over the shared directory, which comes last on the path).
    """
    session.env.update(BYTECODE_ENV)
    marker = SHARED_TORCH / "zero-shared-torch.txt"
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    version = session.run("python", "-c", "import sys; print(*sys.version_info[:2], sep='.')", silent=True)
    want = f"{TORCH} python {str(version).strip()}"
    pth = pathlib.Path(str(purelib).strip()) / "zero_shared_torch.pth"
    if marker.is_file() and marker.read_text() == want and pth.is_file():
        return  # this venv already sees the shared torch (a second _install in one session)
    with _held(SHARED_TORCH.parent / "_shared-torch.lock"):  # CI's lanes may arrive together
        if not marker.is_file() or marker.read_text() != want:
            shutil.rmtree(SHARED_TORCH, ignore_errors=True)
            _pip(session, "--target", str(SHARED_TORCH), "-c", CONSTRAINTS, TORCH)
            marker.write_text(want)
    pth.write_text(str(SHARED_TORCH) + "\n")
    _pip(session, "-c", CONSTRAINTS, TORCH)  # already satisfied: checks the venv sees the pin


@contextlib.contextmanager
def _held(lock: pathlib.Path):
    """An exclusive lock on the file ``lock`` (created if missing) while the block runs."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _internal_deps(dist: str, extras: tuple[str, ...] = ()) -> list[str]:
    """The zero packages ``dist`` (with ``extras``) depends on, transitively, itself last.

    Requirements such as ``zero-comm[quantized]`` pull in that extra's zero packages too.
    """
    seen: list[str] = []

    def visit(name: str, wanted: tuple[str, ...]) -> None:
        meta = tomllib.loads((ROOT / PACKAGE_DIRS[name] / "pyproject.toml").read_text())["project"]
        reqs = list(meta.get("dependencies", []))
        for extra in wanted:
            reqs += meta.get("optional-dependencies", {}).get(extra, [])
        for req in reqs:
            match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", req)
            dep, dep_extras = match.group(1), tuple(filter(None, (match.group(2) or "").split(",")))
            if dep in PACKAGE_DIRS and (dep not in seen or dep_extras):
                visit(dep, dep_extras)
        if name not in seen:
            seen.append(name)

    visit(dist, extras)
    return seen


# pytest-xdist workers per suite (absent: one process). The integration tests spend much of their
# time waiting (launchers, timeouts, rendezvous; the 2 cores were half idle), so two workers share
# them; the tests that bound how long processes take to exit (TIMED_INTEGRATION) run alone after.
XDIST = "pytest-xdist>=3.7"  # 3.7: --no-loadscope-reorder
WORKERS: dict[str, int] = {"integration": 2}
TIMED_INTEGRATION = (
    "test_integration_faults.py",
    "test_integration_robustness.py",
    "test_integration_checkpoint_faults.py",
)


def _pytest(
    session: nox.Session,
    *tests: pathlib.Path,
    env: dict[str, str] | None = TEST_ENV,
    workers: int = 0,
    ignore: tuple[pathlib.Path, ...] = (),
) -> None:
    """Run the tests under ``tests`` but not ``ignore`` (quiet, no cache files in the checkout;
    the 10 slowest listed, so the CI log shows where the suite's time goes), on ``workers``
    xdist workers if any.

    ``--dist loadgroup --no-loadscope-reorder``: tests go out in the groups and the order the
    suite's conftest gives them (integration_tests/conftest.py: a file's tests together, so a
    module fixture that trains runs once, the longest files first); without such a conftest
    every test is its own unit.
    """
    args = ["-q", "-p", "no:cacheprovider", "--durations=10", *map(str, tests)]
    args += [f"--ignore={path}" for path in ignore]
    if workers:
        args += ["-n", str(workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
    session.run("python", "-m", "pytest", *args, env=env)


def _registry():
    """``benchmarks/registry.py`` (standard library only: read before anything is installed)."""
    spec = importlib.util.spec_from_file_location("benchmarks_registry", ROOT / "benchmarks" / "registry.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _bench(session: nox.Session, only: str) -> None:
    """Every run the registry lists for session ``only`` (``-- NAME ...``: those benchmarks only).

    Each is ``python -m benchmarks NAME ARGS --out benchmarks/results`` from the repository root,
    with ``--docs docs`` where the run fills a docs block.
    """
    registry = _registry()
    names = list(session.posargs)
    for name in names:
        registry.find(name)  # an unknown name fails before anything runs
    session.chdir(ROOT)
    for bench in registry.BENCHMARKS:
        if bench.session != only or (names and bench.name not in names):
            continue
        for run in bench.runs:
            where = ["--out", "benchmarks/results", *(["--docs", "docs"] if run.docs else [])]
            session.run("python", "-m", "benchmarks", bench.name, *run.args, *where, env=bench.env())


# Every zero package builds with hatchling alone (its pyproject's build-system).
# (editables: what hatchling needs for an editable install built without isolation.)
BUILD_BACKEND = ("hatchling>=1.24", "editables>=0.5")


def _pip_local(session: nox.Session, *targets: str) -> None:
    """Install checkout paths (``dir`` or ``dir[extras]``) built with the venv's own hatchling."""
    _pip(session, "--no-build-isolation", "-c", CONSTRAINTS, *targets)


def _install(session: nox.Session, *dists: str, extras: str = "test", editable: bool = False) -> None:
    """Install torch (pinned, shared: :func:`_torch`) then ``dists`` with their zero dependencies.

    The packages build without isolation, with the hatchling installed once in the session's venv:
    an isolated build makes a fresh environment and installs hatchling into it for each package
    (seven for zero-full), about 35 of the 40 s an install of zero-full took.
    """
    _torch(session)
    _pip(session, *BUILD_BACKEND)
    closure: list[str] = []
    for dist in dists:
        deps = _internal_deps(dist, tuple(e for e in extras.split(",") if e))
        closure += [d for d in deps if d not in closure]
    args: list[str] = []
    for dist in closure:
        target = (
            f"{ROOT / PACKAGE_DIRS[dist]}[{extras}]"
            if extras and dist in dists
            else str(ROOT / PACKAGE_DIRS[dist])
        )
        args += ["-e", target] if editable else [target]
    _pip_local(session, *args)


# Build order does not matter (each package builds alone); this one is the layer order.
BUILD_ORDER = list(PACKAGE_DIRS)


def _build_dists(
    session: nox.Session, outdir: pathlib.Path, dists: list[str] = BUILD_ORDER
) -> list[pathlib.Path]:
    """Build each package's sdist, then its wheel from that sdist, into ``outdir`` (hatchling).

    Building the wheel from the sdist checks that the sdist holds everything the wheel needs.
    ``--no-isolation``: hatchling is installed once in this session instead of once per build.
    """
    _pip(session, "build>=1.2", *BUILD_BACKEND)
    outdir.mkdir(parents=True, exist_ok=True)
    for old in [*outdir.glob("zero_*.whl"), *outdir.glob("zero_*.tar.gz")]:
        old.unlink()
    for dist in dists:
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", str(outdir), str(ROOT / PACKAGE_DIRS[dist])
        )
    built = sorted(outdir.iterdir())
    session.log("built into " + str(outdir) + ":\n  " + "\n  ".join(p.name for p in built))
    return built


def _has_tests(path: pathlib.Path) -> bool:
    return any(path.rglob("test_*.py"))


def _venv_discarded(fn):
    """Remove the session's venv when the session ends, pass or fail (unless reused with ``-R``).

    A venv holds up to ~1.5 GB (triton, DeepSpeed, transformers; torch is shared): keeping every
    session's filled CI's disk before the last one. This way the disk holds one at a time.
    """

    @functools.wraps(fn)
    def run(session: nox.Session, *args: object, **kwargs: object) -> None:
        try:
            fn(session, *args, **kwargs)
        finally:
            venv = session.virtualenv
            location = getattr(venv, "location", None)
            if location and not getattr(venv, "reuse_existing", False):
                shutil.rmtree(location, ignore_errors=True)
                # The bytecode of the venv's own files (the prefix tree mirrors absolute paths).
                cached = pathlib.Path(BYTECODE_ENV["PYTHONPYCACHEPREFIX"]) / pathlib.Path(
                    location
                ).resolve().relative_to("/")
                shutil.rmtree(cached, ignore_errors=True)
                session.log(f"removed the session's venv {location} (keep it with -R)")

    return run


UNIT_PACKAGES = [d for d in PACKAGE_DIRS]


@nox.session
@_venv_discarded
@nox.parametrize("package", UNIT_PACKAGES, ids=UNIT_PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, installed alone (plus zero-testing for the fixtures)."""
    pkg_dir = ROOT / PACKAGE_DIRS[package]
    # First the package alone (its declared dependencies only): it must import and stand on its own.
    _install(session, package, extras="")
    import_name = package.replace("-", "_")
    session.run("python", "-c", f"import {import_name}; print({import_name}.__doc__.splitlines()[0])")
    _install(session, package, "zero-testing")
    if not _has_tests(pkg_dir / "tests"):
        session.log(f"{package}: not implemented yet (no tests); the import check above is all there is")
        return
    workers = WORKERS.get(package, 0)
    if workers:
        _pip(session, XDIST)
    _pytest(session, pkg_dir / "tests", workers=workers)


# The layer order: each package after every zero package it and its tests build on (checked).
LAYERS = [
    "zero-kernels",
    "zero-launch",
    "zero-comm",
    "zero-testing",
    "zero-offload",
    "zero-params",
    "zero-coord",
    "zero-optim",
    "zero-full",
]


@nox.session
@_venv_discarded
def suite(session: nox.Session) -> None:
    """Every test CI runs that needs torch, in one venv that grows up the layer stack.

    Each package is installed when only the packages below it are: it must import beside them;
    then its unit tests run with its test extras. After zero-full: the integration tests (with
    the peers), the docs site, and last the Triton kernels under the interpreter (so no earlier
    step sees triton). One venv instead of ten: each venv cost CI a minute or two of installing.
    A failed step does not stop the later ones; the session fails at the end, naming each.
    ``nox -s tests`` (a package alone in its venv), ``integration``, ``docs`` and ``kernels``
    run the same steps one at a time.
    """
    for i, package in enumerate(LAYERS):
        below = _internal_deps(package, ("test",))[:-1]
        if not set(below) <= set(LAYERS[:i]):
            session.error(f"LAYERS lists {package} before {sorted(set(below) - set(LAYERS[:i]))}")
    _torch(session)
    _pip(session, *BUILD_BACKEND)
    # zero-testing (the fixtures every package's tests use) joins once the layers it needs are in.
    fixtures_need = set(_internal_deps("zero-testing")[:-1])
    steps = [
        (package, functools.partial(_layer, session, package, fixtures_need <= set(LAYERS[: i + 1])))
        for i, package in enumerate(LAYERS)
    ]
    steps += [
        ("integration", functools.partial(_integration_tests, session)),
        ("docs", functools.partial(_docs_site, session)),
        ("kernels under the Triton interpreter", functools.partial(_kernels_with_triton, session)),
    ]
    failed = []
    for name, step in steps:
        session.log(f"step: {name}")
        try:
            step()
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error("failed steps: " + ", ".join(failed))


def _layer(session: nox.Session, package: str, fixtures: bool) -> None:
    """``package`` installed beside the layers below it, imported, then its unit tests (with
    zero-testing's fixtures if ``fixtures``)."""
    path = ROOT / PACKAGE_DIRS[package]
    _pip_local(session, str(path))
    name = package.replace("-", "_")
    session.run("python", "-c", f"import {name}; print({name}.__doc__.splitlines()[0])")
    testing = [str(ROOT / PACKAGE_DIRS["zero-testing"])] if fixtures else []
    _pip_local(session, f"{path}[test]", *testing)
    _pytest(session, path / "tests")


def _kernels_with_triton(session: nox.Session) -> None:
    _pip_local(session, f"{ROOT / 'kernels'}[test,triton]")
    _kernels_interpreted(session)


@nox.session
@_venv_discarded
def kernels(session: nox.Session) -> None:
    """Triton kernels against their torch reference twins, on CPU under TRITON_INTERPRET=1."""
    _install(session, "zero-kernels", extras="test,triton")
    _kernels_interpreted(session)


def _kernels_interpreted(session: nox.Session) -> None:
    """kernels/tests with triton installed, under its interpreter."""
    env = dict(TEST_ENV, TRITON_INTERPRET="1")
    # The Triton tests skip when triton is missing; here that would hide them, so fail loudly first.
    check = "import triton, triton.language; print('triton', triton.__version__)"
    session.run("python", "-c", check, env=env)
    _pytest(session, ROOT / "kernels/tests", env=env)


# The torch releases the package metadata allows, at both ends (``torch>=2.9,<3``): the smoke set
# runs on each. The whole suite runs on ``TORCH`` (the pin).
TORCH_RANGE = {"oldest": "torch==2.9.0", "newest": "torch==2.15.0"}
# What a release needs beside it: the Triton 3.5 that torch 2.9 brings interprets kernels with
# ``int()`` of one-element numpy arrays, which numpy 2.4 refuses (the kernels' interpreted tests).
TORCH_COMPANIONS = {"torch==2.9.0": ["numpy<2.4"]}
# A stage-1/2/3 run of zero-full against one process on the whole batch (world 2).
SMOKE_PARITY = "mlp-stage1-w2 or mlp-stage2-w2 or mlp-stage3-w2"
SMOKE = "pytest.mark.smoke"


@nox.session(name="torch_smoke")
@_venv_discarded
@nox.parametrize("release", list(TORCH_RANGE.values()), ids=list(TORCH_RANGE))
def torch_smoke(session: nox.Session, release: str) -> None:
    """The smoke set on the oldest and the newest torch zero supports (``-s "torch_smoke(oldest)"``).

    That torch is installed from the index in the session's own venv (not the pin: no
    constraints file), then every zero package editable; the tests marked ``smoke`` of every
    package run (each package's main paths, a few minutes in all), then the stage 1/2/3 parity run
    of integration_tests/test_integration_stages.py.
    """
    session.env.update(BYTECODE_ENV)
    companions = TORCH_COMPANIONS.get(release, [])
    _pip(session, release, *companions)
    _pip(session, *BUILD_BACKEND)
    _pip(
        session,
        "--no-build-isolation",
        release,
        *companions,
        "pytest>=8",
        "hypothesis>=6",
        "safetensors>=0.4",
        *(arg for d in PACKAGE_DIRS.values() for arg in ("-e", str(ROOT / d))),
    )
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    pytest = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5")
    for package_dir in PACKAGE_DIRS.values():  # one run each: its own pytest config and conftest
        # Only the files holding smoke tests: others may import the test extras' peers (lightning).
        files = [
            str(f) for f in sorted((ROOT / package_dir / "tests").glob("test_*.py")) if SMOKE in f.read_text()
        ]
        session.run(*pytest, "-m", "smoke", *files, env=TEST_ENV)
    stages = str(ROOT / "integration_tests/test_integration_stages.py")
    session.run(*pytest, stages, "-k", SMOKE_PARITY, env=TEST_ENV)


INTEGRATION_PEERS = ["deepspeed==0.19.8", "ninja", "accelerate>=1.0", "lightning>=2.4", "peft>=0.13"]


@nox.session
@_venv_discarded
def integration(session: nox.Session) -> None:
    """End-to-end multi-process runs of the whole stack."""
    _install(session, "zero-full", "zero-testing")
    _integration_tests(session)


def _integration_tests(session: nox.Session) -> None:
    """The peers beside zero-full and zero-testing, then integration_tests/ and benchmarks/tests."""
    tests_dir = ROOT / "integration_tests"
    # DeepSpeed: the peer the DeepSpeed-script and DeepSpeed-checkpoint tests run the same code under
    # (without its JIT-built ops: zero_testing.peers; ninja for a user's own runs); grimp: the
    # import graph that test_integration_import_graph.py checks (import-linter's own); accelerate,
    # lightning and peft: the trainer integrations' tests.
    workers = WORKERS.get("integration", 0)
    peers = ["transformers>=4.45", "grimp>=3.4", *INTEGRATION_PEERS, *([XDIST] if workers else [])]
    _pip(session, "-c", CONSTRAINTS, "pytest>=8", *peers)
    if not _has_tests(tests_dir):
        session.log("integration_tests: none yet")
        return
    timed = tuple(tests_dir / name for name in TIMED_INTEGRATION)
    try:
        _pytest(session, tests_dir, workers=workers, ignore=timed)
    finally:  # a failure above still lets the timed tests and the benchmarks' tests run
        _pytest(session, *timed)
        # The benchmarks' own helpers (formulas, storage counting, report files): fast, torch only.
        _pytest(session, ROOT / "benchmarks/tests")


@nox.session
@_venv_discarded
def lint(session: nox.Session) -> None:
    """ruff (style, bugs, no bare assert in library code) and import-linter (the layer rule)."""
    _pip(session, "ruff>=0.6", "import-linter>=2.1")
    # import-linter only reads sources: install the packages without their dependencies.
    _pip(session, *BUILD_BACKEND)
    _pip(
        session,
        "--no-deps",
        "--no-build-isolation",
        *(arg for d in PACKAGE_DIRS.values() for arg in ("-e", str(ROOT / d))),
    )
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"))


@nox.session
@_venv_discarded
def docs(session: nox.Session) -> None:
    """The documentation site, built with --strict (broken links, API refs or undocumented names fail).

    The log's last line says where the site is. ``nox -s docs -- serve`` serves it instead at
    http://127.0.0.1:8000 (rebuilt on change); options after ``serve`` go to ``mkdocs serve``.

    zero-full is installed because a hook (docs/hooks/config_reference.py) renders the
    configuration reference from its config classes at build time.
    """
    _install(session, "zero-full", extras="")
    if session.posargs[:1] == ["serve"]:  # nox -s docs -- serve [mkdocs serve options]
        _pip(session, *DOCS_TOOLS)
        config = str(ROOT / "mkdocs.yml")
        session.run(
            "mkdocs", "serve", "--strict", "--config-file", config, *session.posargs[1:], env=DOCS_ENV
        )
        return
    _docs_site(session)


DOCS_TOOLS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]
DOCS_ENV = {"NO_MKDOCS_2_WARNING": "1"}


def _docs_site(session: nox.Session) -> None:
    """mkdocs build --strict into the session's tmp directory (zero-full already installed)."""
    _pip(session, *DOCS_TOOLS)
    site = pathlib.Path(session.create_tmp()) / "site"
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(ROOT / "mkdocs.yml"),
        "--site-dir",
        str(site),
        env=DOCS_ENV,
    )
    session.log(f"site built: {site / 'index.html'} (serve it with: nox -s docs -- serve)")


@nox.session
def build(session: nox.Session) -> None:
    """Every package's wheel and sdist into dist/ (versions from each package's pyproject.toml).

    Then, in any fresh venv: ``pip install -c constraints.txt --find-links dist zero-full``.
    """
    _build_dists(session, ROOT / "dist")


@nox.session
@_venv_discarded
def wheels(session: nox.Session) -> None:
    """Install zero-comm, then zero-full, by name from freshly built wheels (not editable, not the
    source tree); smoke test each.

    zero-comm first, alone: it imports, only zero-launch came with it, its 2-rank demo; its
    wheelhouse holds only those two, so any other zero dependency it gained fails the install. Then
    zero-full into the same venv from the wheelhouse of every product package: every package
    imports, ``zero report``, README's ``train.py`` under torchrun on 2 ranks, ``zero
    consolidate``. Every command must exit 0 with nothing that looks like a warning on stderr
    (integration_tests/wheel_smoke.py).
    """
    wheelhouse = pathlib.Path(session.create_tmp()) / "dist"
    _build_dists(session, wheelhouse, [d for d in BUILD_ORDER if d != "zero-testing"])
    comm_only = wheelhouse.parent / "dist-zero-comm"
    shutil.rmtree(comm_only, ignore_errors=True)
    comm_only.mkdir()
    for built in [*wheelhouse.glob("zero_comm-*.whl"), *wheelhouse.glob("zero_launch-*.whl")]:
        shutil.copy2(built, comm_only)
    _torch(session)
    smoke = str(ROOT / "integration_tests" / "wheel_smoke.py")
    for dist, house in (("zero-comm", comm_only), ("zero-full", wheelhouse)):
        # The built wheels are found by name; every other requirement comes from the index.
        _pip(session, "-c", CONSTRAINTS, "--find-links", str(house), dist)
        session.run(
            "python", smoke, dist, "--readme", str(ROOT / "README.md"), "--source", str(ROOT), env=TEST_ENV
        )
    # The demo extra resolves too (not installed: the smoke test needs no transformers).
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--dry-run",
        "-q",
        "-c",
        CONSTRAINTS,
        "--find-links",
        str(wheelhouse),
        "zero-full[demo]",
    )


# What CI runs (README's test command), as lanes side by side; each lane runs its sessions one
# after another. The suite keeps both cores busy through its tests; the other lanes are mostly
# downloads and installs (each torch release of the matrix is a few GB from PyPI), then minutes of
# tests, which fill the cores the suite leaves idle while it installs and runs one-process tests.
CI_LANES = (
    ("suite",),
    ("torch_smoke(oldest)", "lint"),
    ("torch_smoke(newest)", "wheels"),
)


class _Lane:
    """One lane of :data:`CI_LANES`: a ``nox`` of its own, its output printed line by line with the
    lane's name in front, its exit status and wall time kept."""

    def __init__(self, sessions: tuple[str, ...], printing: threading.Lock) -> None:
        self.sessions = sessions
        self.name = sessions[0]
        self._printing = printing
        self.started = time.monotonic()
        self.seconds = 0.0  # set by the reader when the lane ends
        command = [sys.executable, "-m", "nox", "--noxfile", str(ROOT / "noxfile.py"), "-s", *sessions]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        self._reader = threading.Thread(target=self._relay, daemon=True)
        self._reader.start()

    def _relay(self) -> None:
        for line in self._proc.stdout:
            with self._printing:
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()
        self._proc.wait()
        self.seconds = time.monotonic() - self.started  # when this lane ended, not when asked

    def wait(self) -> int:
        self._reader.join()
        return self._proc.wait()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()


@nox.session(venv_backend="none", tags=["ci"])
def ci(session: nox.Session) -> None:
    """Everything CI runs: suite, torch_smoke (both ends), lint and wheels, in :data:`CI_LANES`.

    Each lane's lines carry its first session's name; the end lists each lane's time and result.
    The sessions run alone too (``nox -s suite``, ...).
    """
    printing = threading.Lock()
    lanes: list[_Lane] = []
    try:
        lanes = [_Lane(sessions, printing) for sessions in CI_LANES]
        codes = [lane.wait() for lane in lanes]
    finally:
        for lane in lanes:
            lane.stop()
    for lane, code in zip(lanes, codes):
        verdict = "passed" if code == 0 else f"FAILED (exit {code})"
        session.log(f"lane {', '.join(lane.sessions)}: {verdict} in {lane.seconds / 60:.1f} min")
    failed = [lane.name for lane, code in zip(lanes, codes) if code]
    if failed:
        session.error("failed lanes: " + ", ".join(failed))


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: ``zero train``, a GPT-2-style model trained with ZeRO-3 on 2 local gloo processes."""
    _install(session, "zero-full", extras="demo")
    session.run("zero", "train", "--world", "2", "--steps", "30", env=TEST_ENV)


# What the GPU check imports besides torch (module -> pip requirement), installed only when missing.
GPU_CHECK_NEEDS = {
    "numpy": "numpy",
    "pydantic": "pydantic>=2",
    "pytest": "pytest>=8",
    "hypothesis": "hypothesis>=6",
}


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU check on a machine with an accelerator, from a fresh checkout, in a few minutes.

    Runs in the current Python with the machine's own torch (a CUDA build; nothing replaces it):
    zero's packages are imported from the checkout (PYTHONPATH), and only modules the machine
    lacks are pip-installed. First the Triton kernels against their torch twins on the device
    (kernels/tests), then integration_tests/gpu_check.py (stages 0-3, MiCS, offload against one
    process; memory and step time against DDP and FSDP2; the watchdog with a late rank); results
    under benchmarks/results/gpu/. ``nox -s gpu -- --dry-run`` runs the check on CPU with gloo
    (CI runs the same through integration_tests/test_integration_gpu_check.py).
    """
    dry_run = "--dry-run" in session.posargs
    sources = [str(ROOT / d / "src") for d in PACKAGE_DIRS.values()]
    env = dict(TEST_ENV, PYTHONPATH=os.pathsep.join([*sources, os.environ.get("PYTHONPATH", "")]))
    probe = (
        "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    )
    needs = dict(GPU_CHECK_NEEDS, **({} if dry_run else {"triton": "triton"}))
    missing = str(session.run("python", "-c", probe, *needs, silent=True, env=env)).split()
    if missing:
        session.run("python", "-m", "pip", "install", *(needs[m] for m in missing), external=True)
    check = "import torch; print('torch', torch.__version__, torch.accelerator.current_accelerator())"
    session.run("python", "-c", check, env=env)
    if not dry_run:
        kernels = str(ROOT / "kernels/tests/test_kernels_triton.py")
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", kernels, env=env)
    out = str(ROOT / "benchmarks/results/gpu")
    session.run(
        "python", str(ROOT / "integration_tests/gpu_check.py"), "--out", out, *session.posargs, env=env
    )


# Only the bench session installs DeepSpeed (the peer it compares against), with torch held at the pin.
# ninja: DeepSpeed JIT-builds its CPU Adam (the offload benchmark compares against it).
BENCH_PEERS = ["deepspeed==0.19.8", "ninja", "transformers>=4.45", "matplotlib>=3.8"]


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark of benchmarks/registry.py; results (JSON, markdown, plots) under benchmarks/results/.

    The runs each benchmark makes are listed in the registry (``python -m benchmarks list``);
    those that fill a docs block (memory, side-by-side, profile, growth) also update docs/.
    About an hour and a half on 2 idle cores. ``nox -s bench -- memory comm`` runs only the
    benchmarks named.
    """
    _install(session, "zero-full", extras="")
    _pip(session, "-c", CONSTRAINTS, *BENCH_PEERS, "pytest>=8")
    check = "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
    session.run("python", "-c", check, env={"DS_ACCELERATOR": "cpu"})
    session.run("python", "-c", f"import torch; assert torch.__version__.startswith('{TORCH[7:]}')")
    _pytest(session, ROOT / "benchmarks/tests", env=None)
    _bench(session, "bench")


@nox.session(name="cluster-bench")
def cluster_bench(session: nox.Session) -> None:
    """Step time and inter-node bytes at 2 simulated nodes x 2 ranks over a shaped link (needs root).

    The cluster benchmark builds the nodes as network namespaces joined by veth links shaped with
    ``tc`` (``ip`` and ``tc`` come from iproute2, installed with apt-get when missing) and runs
    DDP, ZeRO-3, MiCS (shard = node) and the ZeRO++ variants the installed zero-full implements;
    results in benchmarks/results/cluster.{md,json,png} and the table in docs/benchmarks.md.
    For other settings run it directly: ``python -m benchmarks cluster --rate-mbit 50``.
    """
    if os.geteuid() != 0:
        session.error("cluster-bench needs root: it creates network namespaces and shapes veth links")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        session.run("apt-get", "update", "-q", external=True)
        session.run("apt-get", "install", "-y", "-q", "iproute2", external=True)
    _install(session, "zero-full", "zero-testing", extras="")
    _pip(session, "-c", CONSTRAINTS, "transformers>=4.45", "matplotlib>=3.8")
    _bench(session, "cluster-bench")
