"""int4 packing: two codes per byte, low nibble first (torch reference)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_kernels import pack_int4, unpack_int4

pytestmark = pytest.mark.smoke


def test_layout_low_nibble_first():
    codes = torch.tensor([-8, -1, 0, 7, 3, -5, 1], dtype=torch.int8)
    packed = pack_int4(codes)
    # byte i = (codes[2i] & 0xF) | (codes[2i+1] & 0xF) << 4; the odd tail is padded with a 0 code
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0xF8, 0x70, 0xB3, 0x01]
    assert unpack_int4(packed).tolist() == [-8, -1, 0, 7, 3, -5, 1, 0]
    assert unpack_int4(packed, 7).tolist() == codes.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-8, max_value=7), min_size=0, max_size=513))
def test_round_trip_is_exact(values):
    codes = torch.tensor(values, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == ((len(values) + 1) // 2,)
    assert torch.equal(unpack_int4(packed, len(values)), codes)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_every_byte_unpacks_and_repacks(raw):
    packed = torch.tensor(list(raw), dtype=torch.uint8)
    codes = unpack_int4(packed)
    assert ((codes >= -8) & (codes <= 7)).all()
    assert torch.equal(pack_int4(codes), packed)


def test_multidim_codes_flatten_row_major():
    codes = torch.arange(-8, 8, dtype=torch.int8).view(4, 4)
    assert torch.equal(pack_int4(codes), pack_int4(codes.reshape(-1)))
    assert torch.equal(pack_int4(codes.t()), pack_int4(codes.t().contiguous().view(-1)))


def test_rejects_bad_input():
    with pytest.raises(ValueError, match=r"must lie in \[-8, 7\], got values in \[-9, 3\]"):
        pack_int4(torch.tensor([-9, 3], dtype=torch.int8))
    with pytest.raises(ValueError, match=r"got values in \[0, 8\]"):
        pack_int4(torch.tensor([0, 8], dtype=torch.int8))
    with pytest.raises(TypeError, match="needs int8 codes, got torch.int32"):
        pack_int4(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="needs uint8 bytes"):
        unpack_int4(torch.tensor([1], dtype=torch.int8))
    with pytest.raises(ValueError, match="needs a 1-D tensor"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"numel must be in \[0, 4\] for 2 bytes, got 5"):
        unpack_int4(torch.zeros(2, dtype=torch.uint8), 5)
