"""Properties of the torch reference of quantize / dequantize (REFERENCES.md, Quantization)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_cases import (
    DTYPES,
    assert_reference_bound,
    codes_of,
    group_absmax,
    over_bits,
    over_dtypes,
    over_sizes,
    relative_rmse,
    sample,
)

from zero_kernels import QuantConfig, QuantizedTensor, dequantize, quantize

# ----------------------------------------------------------------------------- config and type


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 6, 16, 32, True, 8.0, "8", None])
def test_config_rejects_bits(bits):
    with pytest.raises(ValueError, match=rf"bits must be 4 or 8, got {re.escape(repr(bits))}"):
        QuantConfig(bits)


@pytest.mark.parametrize("group_size", [0, -2, 2.0, True, None, "64", (1 << 16) + 1])
def test_config_rejects_group_size(group_size):
    with pytest.raises(
        ValueError, match=rf"group_size must be an int in \[1, 65536\], got {re.escape(repr(group_size))}"
    ):
        QuantConfig(8, group_size)


def test_config_int4_needs_even_group():
    with pytest.raises(ValueError, match="must be even for bits=4.*got 7"):
        QuantConfig(4, 7)
    assert QuantConfig(8, 7).group_size == 7
    assert QuantConfig(4, 2).group_size == 2


def test_config_defaults_and_frozen():
    cfg = QuantConfig(8)
    assert (cfg.bits, cfg.group_size, cfg.qmax) == (8, 2048, 127)
    assert QuantConfig(4).qmax == 7
    with pytest.raises(AttributeError):
        cfg.bits = 4  # type: ignore[misc]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [4096, 10007])
@pytest.mark.smoke
def test_payload_matches_reference_formula(bits, numel):
    """Payload = numel*b/8 + 4 bytes per group (padded to whole groups)."""
    cfg = QuantConfig(bits, 2048)
    q = quantize(torch.randn(numel), cfg)
    groups = math.ceil(numel / 2048)
    assert q.nbytes == groups * 2048 * bits // 8 + 4 * groups == cfg.payload_bytes(numel)
    assert q.n_groups == groups and q.padded_numel == groups * 2048


def test_quantized_tensor_validates_its_parts():
    q = quantize(torch.randn(100), QuantConfig(4, 64))
    with pytest.raises(ValueError, match="codes must be a 1-D torch.uint8 tensor for bits=4"):
        QuantizedTensor(q.codes.view(torch.int8), q.scales, 100, 4, 64)
    with pytest.raises(ValueError, match="scales must be a 1-D float32"):
        QuantizedTensor(q.codes, q.scales.double(), 100, 4, 64)
    with pytest.raises(ValueError, match="2 scales but numel=129 with group_size=64 needs 3"):
        QuantizedTensor(q.codes, q.scales, 129, 4, 64)
    with pytest.raises(ValueError, match="codes has 63 entries, expected 64 for 2 groups of 64 at 4 bits"):
        QuantizedTensor(q.codes[:-1], q.scales, 100, 4, 64)
    with pytest.raises(ValueError, match="codes is on"):
        QuantizedTensor(q.codes, q.scales.to("meta"), 100, 4, 64)
    with pytest.raises(ValueError, match="numel must be a non-negative int"):
        QuantizedTensor(q.codes, q.scales, -1, 4, 64)


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="x.dtype must be one of float32, bfloat16, float16, got torch.int32"):
        quantize(torch.arange(5, dtype=torch.int32), QuantConfig(8))
    with pytest.raises(TypeError, match="float64"):
        quantize(torch.zeros(5, dtype=torch.float64), QuantConfig(8))
    with pytest.raises(TypeError, match="config must be a zero_kernels.QuantConfig"):
        quantize(torch.zeros(5), 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize(torch.zeros(5), QuantConfig(8), backend="cuda")


# ----------------------------------------------------------------------------- odd shapes, all dtypes


@over_bits
@over_dtypes
@over_sizes
@pytest.mark.parametrize("group_size", [2048, 64])
@pytest.mark.smoke
def test_round_trip_within_reference_bound(bits, dtype, numel, group_size):
    x = sample(numel, dtype, seed=numel)
    cfg = QuantConfig(bits, group_size)
    q = quantize(x, cfg)
    n_groups = math.ceil(numel / group_size)
    assert q.numel == numel and q.bits == bits and q.group_size == group_size
    assert q.codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert q.codes.shape == (n_groups * group_size * bits // 8,) and q.scales.shape == (n_groups,)
    # scale = absmax / 2**(b-1), exactly
    amax = group_absmax(x, group_size)[::group_size]
    assert torch.equal(q.scales.double(), amax / 2 ** (bits - 1))
    codes = codes_of(q)
    assert ((codes >= -(1 << (bits - 1))) & (codes <= (1 << (bits - 1)) - 1)).all()
    assert (codes[numel:] == 0).all(), "padding must quantize to code 0"
    assert_reference_bound(x, q)


@over_bits
@over_dtypes
@pytest.mark.parametrize("out_dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_dequantize_output_dtype(bits, dtype, out_dtype):
    x = sample(4099, dtype)
    q = quantize(x, QuantConfig(bits, 256))
    full = dequantize(q)
    assert full.dtype == torch.float32 and full.shape == (4099,)
    got = dequantize(q, out_dtype)
    assert got.dtype == out_dtype and got.shape == (4099,)
    assert torch.equal(got, full.to(out_dtype)), "the cast must round the fp32 dequantization"


@over_dtypes
def test_dequantize_into_out(dtype):
    x = sample(2049, torch.float32)
    q = quantize(x, QuantConfig(8, 64))
    out = torch.full((3, 683), float("nan"), dtype=dtype)
    assert dequantize(q, out=out) is out
    assert torch.equal(out.view(-1), dequantize(q, dtype))
    assert dequantize(q, dtype, out=out) is out


def test_dequantize_rejects_bad_out():
    q = quantize(torch.randn(10), QuantConfig(8, 4))
    with pytest.raises(ValueError, match="out must be a contiguous tensor of 10 elements"):
        dequantize(q, out=torch.empty(11))
    with pytest.raises(ValueError, match="contiguous=False"):
        dequantize(q, out=torch.empty(2, 5).t())
    with pytest.raises(ValueError, match="disagrees with out.dtype"):
        dequantize(q, torch.float16, out=torch.empty(10))
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        dequantize(q, torch.int8)


@over_bits
def test_multidim_and_noncontiguous_input_flatten_row_major(bits):
    x = sample(6 * 35).view(6, 35)
    cfg = QuantConfig(bits, 16)
    assert torch.equal(quantize(x, cfg).codes, quantize(x.reshape(-1), cfg).codes)
    xt = x.t()  # non-contiguous
    assert torch.equal(quantize(xt, cfg).codes, quantize(xt.contiguous().view(-1), cfg).codes)


# ----------------------------------------------------------------------------- zeros, clamp, ties


@over_bits
@over_dtypes
def test_zero_groups_have_zero_scale_and_codes(bits, dtype):
    x = sample(300, dtype)
    x[64:128] = 0.0
    x[130] = -0.0
    x[128:192] = -0.0
    q = quantize(x, QuantConfig(bits, 64))
    assert q.scales[1].item() == 0.0 and q.scales[2].item() == 0.0
    assert math.copysign(1.0, q.scales[2].item()) == 1.0, "scale of a -0.0 group must be +0.0"
    codes = codes_of(q)
    assert (codes[64:192] == 0).all()
    y = dequantize(q)
    assert not y.isnan().any()
    assert (y[64:192] == 0).all()
    zeros = quantize(torch.zeros(5000, dtype=dtype), QuantConfig(bits))
    assert (zeros.scales == 0).all() and (codes_of(zeros) == 0).all()
    assert torch.equal(dequantize(zeros), torch.zeros(5000))


@over_bits
def test_top_code_clamp(bits):
    """+A lands on 2**(b-1) and is clamped to the top code: error exactly A / 2**(b-1); -A is exact."""
    half = 1 << (bits - 1)
    scale = 0.375
    a = half * scale
    x = torch.tensor([a, -a, (half - 0.5) * scale + 1e-3, (half - 0.5) * scale - 1e-3, 0.0, 0.0])
    q = quantize(x, QuantConfig(bits, 6))
    assert q.scales.item() == scale
    assert codes_of(q)[:4].tolist() == [half - 1, -half, half - 1, half - 1]
    y = dequantize(q)
    assert y[0].item() == a - scale  # the clamped value: error = one step = A / 2**(b-1)
    assert y[1].item() == -a
    assert scale / 2 < abs(x[2].item() - y[2].item()) <= scale  # above the last rounding boundary: clamped
    assert abs(x[3].item() - y[3].item()) <= scale / 2  # below it: rounded, error <= A / 2**b
    assert_reference_bound(x, q)


@over_bits
@over_dtypes
def test_ties_round_half_to_even(bits, dtype):
    half = 1 << (bits - 1)
    ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 5.5, -6.5]
    x = torch.tensor([float(half)] + ties, dtype=dtype)  # absmax 2**(b-1): scale 1
    q = quantize(x, QuantConfig(bits, 12))
    assert q.scales.item() == 1.0
    expected = [half - 1] + [int(torch.round(torch.tensor(t)).item()) for t in ties]
    assert expected[1:] == [0, 2, 2, 0, -2, -2, 4, -4, 6, -6]
    assert codes_of(q)[:11].tolist() == expected


# ----------------------------------------------------------------------------- error statistics


@pytest.mark.parametrize(
    ("bits", "group_size", "low", "high"),
    [(8, 4096, 0.008, 0.0095), (4, 2048, 0.12, 0.14)],
    ids=["int8-g4096", "int4-g2048"],
)
def test_gaussian_relative_rmse_matches_references(bits, group_size, low, high):
    """REFERENCES: Gaussian data, int8 group 4096 ~ 0.9%, int4 group 2048 ~ 13%."""
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(7))
    rmse = relative_rmse(dequantize(quantize(x, QuantConfig(bits, group_size))), x)
    assert low <= rmse <= high, f"relative RMSE {rmse:.4f} outside [{low}, {high}]"


_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32).filter(
    lambda v: v == 0.0 or abs(v) >= 1e-30
)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(_finite, min_size=0, max_size=300),
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([2, 6, 16, 64]),
)
def test_bound_holds_for_any_finite_input(values, bits, group_size):
    """Inputs with |x| >= 1e-30 (scales stay normal fp32) or exactly 0."""
    x = torch.tensor(values, dtype=torch.float32)
    assert_reference_bound(x, quantize(x, QuantConfig(bits, group_size)))
