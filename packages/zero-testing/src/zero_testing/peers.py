"""The peers tests compare zero against, prepared the way the tests run them.

:func:`deepspeed_for_training` imports DeepSpeed on the CPU accelerator with its shared-memory
all-reduce marked unavailable. That op serves only DeepSpeed's ``inference_all_reduce``; a
training step's collectives go through ``torch.distributed`` either way. Built, it is a C++
compile of about 80 CPU seconds at the first ``init_distributed`` on a machine whose extension
cache is empty, which is every fresh CI machine.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["deepspeed_for_training", "DEEPSPEED_SHM_OP"]

DEEPSPEED_SHM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME


def deepspeed_for_training() -> ModuleType:
    """``import deepspeed`` (``DS_ACCELERATOR=cpu`` unless set) without its shared-memory op.

    DeepSpeed probes which ops can be built once per process and keeps the answer in
    ``deepspeed.ops.__compatible_ops__``, a dict that it reads again before building one;
    an op marked ``False`` there is not built and its caller takes the fallback path.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise ImportError("DeepSpeed is not installed: pip install zero-testing[peers]") from exc

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False
    return deepspeed
