"""Triton kernels against their torch reference twins: identical codes, scales and outputs.

Without a GPU the kernels run in Triton's CPU interpreter, which needs ``TRITON_INTERPRET=1``
before triton is first imported (triton decorates its own ``tl.max`` ... then) and before
``zero_kernels`` is (its kernels are decorated then). ``nox -s kernels`` sets it in the
environment; conftest.py sets it for a whole-directory run (other test modules import
zero_kernels first); the lines below set it for a run of this file alone -- each only when no CUDA
device is present and the variable is not set already. On a CUDA machine without the variable the
compiled kernels are checked on CUDA tensors instead. Skipped only when triton is not importable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip(
    "triton",
    reason="triton is not importable: install zero-kernels[triton] to check the Triton kernels",
    exc_type=ImportError,
)

from kernels_cases import (  # noqa: E402
    DTYPES,
    ODD_SIZES,
    over_bits,
    over_dtypes,
    over_sizes,
    sample,
    simulate_qgz,
    stack,
)

from zero_kernels import (  # noqa: E402
    QuantConfig,
    dequant_reduce,
    dequant_reduce_requant,
    dequantize,
    pack_int4,
    quantize,
    swizzled_quantize,
    triton_interpreting,
    unpack_int4,
)

INTERPRET = triton_interpreting()
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def on_device(x: torch.Tensor) -> torch.Tensor:
    return x.to(DEVICE)


def assert_same_q(got, want, what: str) -> None:
    assert got.numel == want.numel and got.bits == want.bits and got.group_size == want.group_size, what
    assert got.codes.dtype == want.codes.dtype, what
    assert torch.equal(got.codes, want.codes), (
        f"{what}: codes differ at {(got.codes != want.codes).sum()} places"
    )
    assert torch.equal(got.scales, want.scales), f"{what}: scales differ"


def test_runs_interpreted_or_on_cuda():
    assert INTERPRET or DEVICE == "cuda", "Triton kernels on CPU tensors need TRITON_INTERPRET=1"


def tricky(numel: int, dtype: torch.dtype, bits: int, group_size: int) -> torch.Tensor:
    """Varying magnitudes, zeros, and a first group of absmax 2**(b-1) (scale 1) that starts with a
    clamped +A, exact ties and -A."""
    x = sample(numel, dtype, seed=numel + bits)
    half = float(1 << (bits - 1))
    x[:group_size] = x[:group_size].clamp(-half + 1, half - 1)
    head = torch.tensor([half, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, half - 0.5, -half], dtype=dtype)
    k = min(numel, group_size, head.numel())
    x[:k] = head[:k]
    return x


# ----------------------------------------------------------------------------- quantize / dequantize


@over_bits
@over_dtypes
@over_sizes
@pytest.mark.parametrize("group_size", [2048, 64])
def test_quantize_and_dequantize_match_reference(bits, dtype, numel, group_size):
    x = on_device(tricky(numel, dtype, bits, group_size))
    cfg = QuantConfig(bits, group_size)
    want = quantize(x, cfg, backend="torch")
    got = quantize(x, cfg, backend="triton")
    assert_same_q(got, want, "quantize")
    for out_dtype in DTYPES.values():
        ref = dequantize(want, out_dtype, backend="torch")
        tri = dequantize(want, out_dtype, backend="triton")
        assert tri.dtype == out_dtype and torch.equal(tri, ref), f"dequantize to {out_dtype}"


@pytest.mark.parametrize("group_size", [1, 2, 7, 100, 4096])
@pytest.mark.parametrize("numel", [1, 131, 2049])
def test_unusual_group_sizes(group_size, numel):
    bits = 8 if group_size % 2 else 4
    x = on_device(sample(numel, torch.float32, seed=group_size))
    cfg = QuantConfig(bits, group_size)
    want = quantize(x, cfg, backend="torch")
    assert_same_q(quantize(x, cfg, backend="triton"), want, "quantize")
    assert torch.equal(dequantize(want, backend="triton"), dequantize(want, backend="torch"))


@over_bits
def test_dequantize_into_out_and_zero_groups(bits):
    x = on_device(sample(1000, torch.bfloat16))
    x[100:400] = 0.0
    q = quantize(x, QuantConfig(bits, 100), backend="triton")
    assert (q.scales[1:4] == 0).all()
    out = torch.full((10, 100), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert dequantize(q, out=out, backend="triton") is out
    assert torch.equal(out.view(-1), dequantize(q, torch.bfloat16, backend="torch"))


# ----------------------------------------------------------------------------- qgZ kernels

TOPOLOGIES = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3)]


@pytest.mark.parametrize(("num_nodes", "rpn"), TOPOLOGIES, ids=[f"{n}x{r}" for n, r in TOPOLOGIES])
@pytest.mark.parametrize("partition", [0, 1, 7, 131, 1023])
@over_bits
@over_dtypes
def test_swizzled_quantize_matches_reference(num_nodes, rpn, partition, bits, dtype):
    x = on_device(sample(num_nodes * rpn * partition, dtype, seed=partition))
    cfg = QuantConfig(bits, 64)
    want = swizzled_quantize(x, cfg, num_nodes, rpn, backend="torch")
    assert_same_q(swizzled_quantize(x, cfg, num_nodes, rpn, backend="triton"), want, "swizzled_quantize")


@pytest.mark.parametrize("n_sources", [1, 2, 3])
@pytest.mark.parametrize(("bits_in", "bits_out"), [(8, 8), (4, 4), (8, 4), (4, 8)])
@pytest.mark.parametrize("group_size", [64, 2048])
def test_fused_reductions_match_reference(n_sources, bits_in, bits_out, group_size):
    chunks = [
        on_device(tricky(2 * group_size, torch.float32, bits_in, group_size)) * (s + 1)
        for s in range(n_sources)
    ]
    stacked = stack([quantize(c, QuantConfig(bits_in, group_size), backend="torch") for c in chunks])
    cfg = QuantConfig(bits_out, group_size)
    want = dequant_reduce_requant(stacked, n_sources, cfg, backend="torch")
    assert_same_q(dequant_reduce_requant(stacked, n_sources, cfg, backend="triton"), want, "requant")
    for out_dtype in DTYPES.values():
        ref = dequant_reduce(stacked, n_sources, out_dtype, backend="torch")
        tri = dequant_reduce(stacked, n_sources, out_dtype, backend="triton")
        assert torch.equal(tri, ref), f"dequant_reduce to {out_dtype}"


def test_single_source_reduce_of_odd_size():
    q = quantize(on_device(sample(131)), QuantConfig(4, 64), backend="torch")
    assert torch.equal(dequant_reduce(q, 1, backend="triton"), dequant_reduce(q, 1, backend="torch"))


@pytest.mark.parametrize(("num_nodes", "rpn"), [(2, 2), (1, 3), (3, 1)])
@over_bits
def test_two_hop_simulation_is_bitwise_the_reference(num_nodes, rpn, bits):
    world, partition = num_nodes * rpn, 300
    grads = [on_device(sample(world * partition, torch.float32, seed=r)) for r in range(world)]
    cfg = QuantConfig(bits, 64)
    want, _ = simulate_qgz(grads, cfg, num_nodes, rpn, backend="torch")
    got, _ = simulate_qgz(grads, cfg, num_nodes, rpn, backend="triton")
    for p in range(world):
        assert torch.equal(got[p], want[p]), f"rank {p}"


# ----------------------------------------------------------------------------- int4 packing


@pytest.mark.parametrize("numel", ODD_SIZES)
def test_pack_unpack_match_reference(numel):
    gen = torch.Generator().manual_seed(numel)
    codes = on_device(torch.randint(-8, 8, (numel,), generator=gen, dtype=torch.int8))
    packed = pack_int4(codes, backend="triton")
    assert torch.equal(packed, pack_int4(codes, backend="torch"))
    assert torch.equal(unpack_int4(packed, numel, backend="triton"), codes)
    assert torch.equal(unpack_int4(packed, backend="triton"), unpack_int4(packed, backend="torch"))
