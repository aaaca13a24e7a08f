"""The 32-point rotation and 6-bit packing."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxflux.mx import hadamard32, pack_bits6, unpack_bits6
from mxflux.mx.hadamard import HADAMARD_SCALE, hadamard32_by_gemm


def sylvester(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def butterfly_loop_fp32(v: np.ndarray) -> np.ndarray:
    """The textbook in-place FWHT, h = 1, 2, 4, 8, 16, scalar fp32: the definition's add order."""
    x = v.astype(np.float32).copy()
    h = 1
    while h < 32:
        for i in range(0, 32, 2 * h):
            for j in range(i, i + h):
                a, b = x[j], x[j + h]
                x[j], x[j + h] = np.float32(a + b), np.float32(a - b)
        h *= 2
    return x * np.float32(HADAMARD_SCALE)


def test_scale_is_fp32_of_one_over_sqrt32():
    assert HADAMARD_SCALE == float(np.float32(1 / math.sqrt(32)))


def test_bit_identical_to_the_scalar_butterfly_order(gen):
    x = torch.randn(6, 32, generator=gen) * torch.exp2(torch.randint(-30, 30, (6, 32), generator=gen).float())
    got = hadamard32(x).numpy()
    for r in range(6):
        assert np.array_equal(got[r], butterfly_loop_fp32(x[r].numpy()))


def test_is_the_sylvester_matrix(gen):
    x = torch.randn(16, 96, generator=gen, dtype=torch.float32)
    h = sylvester(32) / math.sqrt(32)
    want = (x.double().numpy().reshape(16, 3, 32) @ h.T).reshape(16, 96)
    assert np.allclose(hadamard32(x).double().numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_applied_twice_is_the_identity(gen):
    x = torch.randn(64, 256, generator=gen)
    back = hadamard32(hadamard32(x))
    assert torch.allclose(back, x, rtol=0, atol=4 * torch.finfo(torch.float32).eps * x.abs().max())


def test_rotation_cancels_along_the_contraction_axis(gen):
    a = torch.randn(128, 512, generator=gen)
    b = torch.randn(96, 512, generator=gen)
    ref = a.double() @ b.double().t()
    got = hadamard32(a).double() @ hadamard32(b).double().t()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-6  # fp32 rounding of the rotated operands only


def test_other_axes_and_dtypes(gen):
    x = torch.randn(64, 8, generator=gen).bfloat16()
    assert torch.equal(hadamard32(x, axis=0), hadamard32(x.t().contiguous()).t())
    assert hadamard32(x, axis=0).dtype == torch.float32
    with pytest.raises(ValueError, match="x: length 8 along axis 1 is not a multiple of 32"):
        hadamard32(x, axis=1)
    with pytest.raises(ValueError, match="x: expected a floating-point tensor"):
        hadamard32(torch.zeros(32, dtype=torch.int64))


@settings(max_examples=100, deadline=None)
@given(lead=st.integers(0, 3), groups=st.integers(1, 16), seed=st.integers(0, 2**31 - 1))
def test_pack_bits6_round_trip_is_lossless(lead, groups, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (lead + 1, 4 * groups)
    codes = torch.randint(0, 64, shape, generator=g, dtype=torch.uint8)
    packed = pack_bits6(codes)
    assert packed.shape == (lead + 1, 3 * groups) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits6(packed, 4 * groups), codes)


def test_pack_bits6_layout_is_little_endian():
    codes = torch.tensor([1, 2, 3, 63], dtype=torch.uint8)
    word = 1 | 2 << 6 | 3 << 12 | 63 << 18
    assert pack_bits6(codes).tolist() == [word & 0xFF, word >> 8 & 0xFF, word >> 16 & 0xFF]


def test_pack_bits6_errors():
    with pytest.raises(ValueError, match="codes: last-axis length 6 is not a multiple of 4"):
        pack_bits6(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes: values must be 6-bit"):
        pack_bits6(torch.full((4,), 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes: expected a uint8 tensor"):
        pack_bits6(torch.zeros(4))
    with pytest.raises(ValueError, match="n: 6 is not a multiple of 4"):
        unpack_bits6(torch.zeros(3, dtype=torch.uint8), 6)
    with pytest.raises(ValueError, match="packed: expected last-axis length 6"):
        unpack_bits6(torch.zeros(3, dtype=torch.uint8), 8)


def test_the_rotation_as_a_gemm_is_the_butterflies_within_rounding(gen):
    """`hadamard32_by_gemm` (the frozen base's dgrad undoes the rotation with it) applies the same
    matrix as the butterflies: in fp32 within fp32 rounding, in bf16 within its two roundings; and
    it undoes `hadamard32`."""
    x = torch.randn(6, 3, 96, generator=gen) * torch.logspace(-3, 3, 96)
    torch.testing.assert_close(hadamard32_by_gemm(x), hadamard32(x), rtol=1e-6, atol=1e-6 * x.abs().max().item())
    got, want = hadamard32_by_gemm(x.bfloat16()), hadamard32(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    block_max = want.abs().view(-1, 32).amax(-1, keepdim=True).expand(-1, 32).reshape(want.shape)
    assert ((got.float() - want).abs() <= 2**-7 * block_max).all()
    torch.testing.assert_close(hadamard32_by_gemm(hadamard32(x)), x, rtol=1e-5, atol=1e-5 * x.abs().max().item())
