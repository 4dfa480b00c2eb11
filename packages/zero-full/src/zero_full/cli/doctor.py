"""Environment and backend check behind ``zero report``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import time

from zero_launch import LaunchError, RankContext, RankFailureKind, launch

__all__ = ["EnvironmentReport", "SmokeResult", "collect_report", "gloo_smoke_check", "ZERO_DISTRIBUTIONS"]

ZERO_DISTRIBUTIONS = (
    "zero-kernels",
    "zero-launch",
    "zero-comm",
    "zero-offload",
    "zero-params",
    "zero-coord",
    "zero-optim",
    "zero-full",
)

_SMOKE_WORLD = 2


@dataclasses.dataclass(frozen=True)
class SmokeResult:
    """Outcome of :func:`gloo_smoke_check`."""

    ok: bool
    detail: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class EnvironmentReport:
    """What ``zero report`` prints; every field is plain data."""

    python: str
    executable: str
    platform: str
    cpu_count: int | None
    torch: str
    distributed: bool
    backends: dict[str, bool]
    accelerator: str | None
    accelerator_count: int
    cuda: str | None
    triton: str | None
    packages: dict[str, str | None]
    smoke: SmokeResult | None
    missing: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def _backends(dist: object) -> dict[str, bool]:
    names = ("gloo", "nccl", "mpi", "ucc", "xccl")
    found = {}
    for name in names:
        probe = getattr(dist, f"is_{name}_available", None)
        found[name] = bool(probe()) if callable(probe) else False
    return found


def _installed_version(dist: str) -> str | None:
    """The version of distribution ``dist``; ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    version = _installed_version("triton")
    if version is None:  # importable, but no distribution is named triton
        import triton

        version = str(getattr(triton, "__version__", "unknown"))
    return version


def _package_versions() -> dict[str, str | None]:
    return {name: _installed_version(name) for name in ZERO_DISTRIBUTIONS}


def _missing_requirements() -> tuple[str, ...]:
    missing = []
    for name in ZERO_DISTRIBUTIONS:
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req.replace('"', " ").replace("'", " "):
                continue
            dep = re.match(r"[A-Za-z0-9_.-]+", req.strip())
            if dep is None:
                continue
            if _installed_version(dep.group(0)) is None:
                missing.append(f"{name} needs {req.split(';')[0].strip()}")
    return tuple(missing)


def collect_report(smoke: bool = True, smoke_timeout: float = 30.0) -> EnvironmentReport:
    """Gather the environment report."""
    import torch
    import torch.distributed as dist

    available = dist.is_available()
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return EnvironmentReport(
        python=f"{platform.python_implementation()} {platform.python_version()}",
        executable=sys.executable,
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        distributed=available,
        backends=_backends(dist) if available else {},
        accelerator=accel.type if accel is not None else None,
        accelerator_count=torch.accelerator.device_count() if accel is not None else 0,
        cuda=torch.version.cuda,
        triton=_triton_version(),
        packages=_package_versions(),
        smoke=gloo_smoke_check(smoke_timeout) if smoke and available else None,
        missing=_missing_requirements(),
    )


def _smoke_rank(ctx: RankContext) -> float:
    """One rank of the smoke check (launched in its gloo group): all-reduce ``rank + 1``."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return value.item()


def gloo_smoke_check(timeout: float = 30.0) -> SmokeResult:
    """All-reduce over gloo between 2 spawned local processes (:func:`zero_launch.launch`)."""
    start = time.monotonic()
    expected = float(sum(range(1, _SMOKE_WORLD + 1)))
    try:
        values = {
            r.rank: r.value for r in launch(_smoke_rank, _SMOKE_WORLD, timeout=timeout, name="zero-report")
        }
    except LaunchError as exc:
        seconds = time.monotonic() - start
        first = exc.failures[0]
        if first.kind is RankFailureKind.TIMED_OUT:
            running = list(exc.still_running)
            return SmokeResult(
                False, f"rank(s) {running} did not finish within {timeout:g} s (killed)", seconds
            )
        return SmokeResult(False, f"rank {first.rank} failed: {first.summary}", seconds)
    seconds = time.monotonic() - start
    wrong = {r: v for r, v in values.items() if v != expected}
    if wrong:
        return SmokeResult(False, f"all_reduce gave {wrong}, expected {expected:g} on every rank", seconds)
    detail = f"all_reduce over gloo on {_SMOKE_WORLD} spawned processes: {expected:g} on every rank"
    return SmokeResult(True, detail, seconds)
