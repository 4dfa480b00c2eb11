"""``init_distributed`` and ``add_config_arguments``: how a DeepSpeed script starts."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LAUNCH_HINT", "add_config_arguments", "default_backend", "init_distributed"]

LAUNCH_HINT = (
    "start the script under a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
    "MASTER_PORT, e.g. `torchrun --nproc-per-node N script.py ARGS` (one node) or `torchrun "
    "--nnodes M --nproc-per-node N --rdzv-endpoint HOST:PORT script.py ARGS` (several); for a "
    "single process: `torchrun --nproc-per-node 1 script.py ARGS`"
)
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_OMPI = {
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
}


def default_backend() -> str:
    """``torch.distributed``'s default backend for this process's device (``gloo`` on the CPU)."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return dist.get_default_backend_for_device(acc.type)
    return "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group as DeepSpeed does (nothing if it exists already)."""
    if dist_init_required is False or (dist.is_available() and dist.is_initialized()):
        return
    if init_method is None and (rank < 0 or world_size < 0):
        _environment_from_mpi(auto_mpi_discovery, distributed_port)
        missing = [k for k in _REQUIRED if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_distributed: no distributed launcher found ({', '.join(missing)} not set); "
                + LAUNCH_HINT
            )
    backend = dist_backend or default_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend != "gloo" and torch.accelerator.is_available():
        torch.accelerator.set_device_index(local_rank)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "init_method": init_method}
    if rank >= 0 and world_size >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    if verbose and dist.get_rank() == 0:
        print(f"zero: initialized {backend} process group, world size {dist.get_world_size()}", flush=True)


def _environment_from_mpi(auto_mpi_discovery: bool, port: int) -> None:
    """Fill the launcher's variables from Open MPI's when only those are set."""
    if not auto_mpi_discovery or "RANK" in os.environ or _OMPI["RANK"] not in os.environ:
        return
    for ours, theirs in _OMPI.items():
        os.environ.setdefault(ours, os.environ[theirs])
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(port))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line arguments to ``parser`` and return it.

    ``--deepspeed`` (a flag for the script's own use), ``--deepspeed_config PATH`` (read by
    :func:`zero_full.deepspeed.initialize` from ``args``) and the deprecated ``--deepscale``
    / ``--deepscale_config``.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable DeepSpeed (for the script)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser
