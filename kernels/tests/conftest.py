"""Run zero_kernels' Triton kernels in Triton's CPU interpreter when there is no GPU.

Triton fixes interpreter-or-compiler when triton (its own ``tl.max``, ...) and zero_kernels (the
kernels) are imported, so ``TRITON_INTERPRET`` has to be set before any test module imports them;
pytest imports this file first. test_kernels_triton.py does the same for a run of that file alone.
An explicit ``TRITON_INTERPRET`` in the environment wins.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
