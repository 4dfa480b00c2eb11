"""Backend dispatch, and ``import zero_kernels`` without triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_kernels
from zero_kernels import resolve_backend


@pytest.mark.smoke
def test_auto_uses_the_reference_on_cpu():
    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    assert resolve_backend("torch", torch.zeros(1)) == "torch"


@pytest.mark.smoke
def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        resolve_backend("cuda", torch.zeros(1))


COMPILED_TRITON_ON_CPU = textwrap.dedent(
    """
    import torch
    import zero_kernels as zk

    assert zk.HAS_TRITON and not zk.triton_interpreting()
    try:
        zk.quantize(torch.zeros(4), zk.QuantConfig(8), backend="triton")
    except ValueError as e:
        assert "got a tensor on cpu" in str(e) and "TRITON_INTERPRET=1" in str(e), e
    else:
        raise AssertionError("compiled Triton kernels on a CPU tensor must be refused")
    assert zk.resolve_backend("auto", torch.zeros(1)) == "torch"
    print("ok")
    """
)


@pytest.mark.skipif(not zero_kernels.HAS_TRITON, reason="needs triton importable to reach the device check")
def test_compiled_triton_refuses_cpu_tensors():
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_TRITON_ON_CPU], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


BLOCK_TRITON = textwrap.dedent(
    """
    import importlib.util, sys

    # As where triton is not installed: importing it fails and find_spec answers None (torch 2.15
    # probes triton with find_spec when it is imported).
    sys.modules["triton"] = None
    assert importlib.util.find_spec("triton") is None
    import torch
    import zero_kernels as zk

    assert not zk.HAS_TRITON
    assert sys.modules["triton"] is None, "something imported triton past the block"
    x = torch.randn(1000)
    q = zk.quantize(x, zk.QuantConfig(4, 64))
    assert (zk.dequantize(q) - x).abs().max() <= x.abs().max() / 8 * 1.001
    q = zk.swizzled_quantize(x, zk.QuantConfig(8, 64), 2, 2)
    assert zk.dequant_reduce(q, 2).numel() == q.numel // 2
    assert zk.unpack_int4(zk.pack_int4(torch.tensor([-8, 7], dtype=torch.int8))).tolist() == [-8, 7]
    try:
        zk.quantize(x, zk.QuantConfig(8), backend="triton")
    except RuntimeError as e:
        assert "pip install 'zero-kernels[triton]'" in str(e), e
    else:
        raise AssertionError("backend='triton' without triton must raise")
    print("ok")
    """
)


def test_import_and_use_without_triton():
    result = subprocess.run([sys.executable, "-c", BLOCK_TRITON], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
