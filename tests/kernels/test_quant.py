"""The rotation and the two quantizers: kernels against references byte for byte, q4_0
against gguf byte for byte, and properties of the references (the spec) under hypothesis."""
import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numba import cuda, float32

from strata_nb.kernels.kv.hadamard import hadamard, hadamard_ref
from strata_nb.kernels.kv.quant_int8 import (F16_MAX, dequantize_int8_column, dequantize_int8_ref,
                                          quantize_int8, quantize_int8_ref, sanitize_ref)
from strata_nb.kernels.kv.quant_q4_0 import (dequantize_q4_0_column, dequantize_q4_0_ref, quantize_q4_0,
                                          quantize_q4_0_ref)
from strata_nb.kv_layout import BLOCK

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def awkward_rows(seed, n_rows, width):
    """Normal rows of varied scale, plus the rows a quantizer gets wrong first: all zeros,
    ties in max|x| (opposite signs, the negative one first), NaN and +-inf, values beyond
    fp16, values below the flush threshold and just above it, a lone outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, width)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 4, (n_rows, 1)).astype(np.float32)
    x[0] = 0
    x[1, :] = 1.5
    x[1, 3], x[1, 7] = -3.0, 3.0
    x[2, 5], x[2, 40], x[2, 41] = np.nan, np.inf, -np.inf
    x[3, 0], x[3, 33] = 1e30, -7e5
    x[4] = np.float32(1e-37)
    x[4, 9] = -np.float32(3e-38)
    x[5, 17] = 900.0
    x[6] *= np.float32(1e-36) / np.abs(x[6]).max()  # just above the flush: 1 / d stays finite
    return x


def as_bits(a):
    return a.view(np.uint8)


# ---- rotation ------------------------------------------------------------------------------

def test_hadamard_is_orthonormal_symmetric_and_its_own_inverse():
    h = hadamard_ref(np.eye(64, dtype=np.float32))  # row i is H applied to e_i: the matrix
    assert set(np.abs(h).ravel()) == {np.float32(1 / 8)}
    assert np.array_equal(h, h.T)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    x = np.random.default_rng(0).standard_normal((5, 3, 128)).astype(np.float32)
    np.testing.assert_allclose(hadamard_ref(hadamard_ref(x)), x, atol=1e-6)


def test_hadamard_kernel_matches_ref():
    x = np.random.default_rng(1).standard_normal((7, 192)).astype(np.float32)
    np.testing.assert_allclose(hadamard(x), hadamard_ref(x), atol=1e-6, rtol=0)


# ---- kernels against references ------------------------------------------------------------

def test_launchers_take_device_arrays_and_return_them():
    """The cuda backend passes device arrays: the result stays on the device."""
    x = awkward_rows(6, 7, 128)
    on_device = cuda.to_device(x)
    codes, scales = quantize_int8(on_device)
    want_codes, want_scales = quantize_int8_ref(x)
    assert as_bits(codes.copy_to_host()).tobytes() == as_bits(want_codes).tobytes()
    assert as_bits(scales.copy_to_host()).tobytes() == as_bits(want_scales).tobytes()
    assert quantize_q4_0(on_device).copy_to_host().tobytes() == quantize_q4_0_ref(x).tobytes()
    y = np.random.default_rng(6).standard_normal((7, 128)).astype(np.float32)
    np.testing.assert_allclose(hadamard(cuda.to_device(y)).copy_to_host(), hadamard_ref(y), atol=1e-6, rtol=0)


def test_int8_kernel_matches_ref_byte_for_byte():
    x = awkward_rows(2, 11, 128)
    codes, scales = quantize_int8(x)
    want_codes, want_scales = quantize_int8_ref(x)
    assert as_bits(codes).tobytes() == as_bits(want_codes).tobytes()
    assert as_bits(scales).tobytes() == as_bits(want_scales).tobytes()


def test_q4_0_kernel_matches_ref_byte_for_byte():
    x = awkward_rows(3, 11, 128)
    assert quantize_q4_0(x).tobytes() == quantize_q4_0_ref(x).tobytes()


@cuda.jit
def unpack_columns(codes, scales, q4, q4_d, int8_out, q4_out):
    # one thread per (block, head, value j): value j of the block's 16 rows, as attention reads
    r, h, j = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    column = cuda.local.array(BLOCK, float32)
    dequantize_int8_column(codes, scales, r, h, j, column)
    for c in range(BLOCK):
        int8_out[r, h, c, j] = column[c]
    dequantize_q4_0_column(q4, q4_d, r, h, j, column)
    for c in range(BLOCK):
        q4_out[r, h, c, j] = column[c]


def test_device_dequantizers_match_refs_exactly():
    x = awkward_rows(4, 2 * 1 * BLOCK, 64).reshape(2, 1, BLOCK, 64)  # a pool: 2 blocks, 1 KV head
    codes, scales = quantize_int8_ref(x)
    q4 = quantize_q4_0_ref(x)
    int8_out, q4_out = np.zeros_like(x), np.zeros_like(x)
    unpack_columns[(2, 1), 64](codes, scales, q4, q4.view(np.float16), int8_out, q4_out)
    assert int8_out.tobytes() == dequantize_int8_ref(codes, scales).tobytes()
    assert q4_out.tobytes() == dequantize_q4_0_ref(q4).tobytes()


# ---- q4_0 against gguf ---------------------------------------------------------------------

def test_q4_0_ref_equals_gguf_on_ordinary_and_tied_values():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((13, 3, 64)).astype(np.float32) * np.float32(4.0)
    x[0, 0] = 0  # an all-zero row: d = -0.0, every code 8
    x[1, 1, :32] = rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0], 32)  # ties in max|x|
    x[2, 2, :32] = 3.0
    x[2, 2, 4] = -3.0  # the tie, first in row order: gguf takes its sign
    assert quantize_q4_0_ref(x).tobytes() == gguf.quants.quantize(x, Q4_0).tobytes()


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
blocks_of_anything = arrays(np.float32, st.tuples(st.integers(1, 4), st.just(64)), elements=floats32)
# Few distinct magnitudes: ties in max|x| in almost every block.
blocks_with_ties = arrays(np.float32, st.tuples(st.integers(1, 4), st.just(64)),
                          elements=st.sampled_from([-4.0, -2.5, -1.0, -0.0, 0.0, 1.0, 2.5, 4.0]))


@settings(max_examples=150, deadline=None)
@given(st.one_of(blocks_of_anything, blocks_with_ties))
def test_q4_0_ref_equals_gguf_after_the_policy(x):
    assert quantize_q4_0_ref(x).tobytes() == gguf.quants.quantize(sanitize_ref(x), Q4_0).tobytes()


# ---- the non-finite policy -----------------------------------------------------------------

def test_policy_maps_nan_inf_huge_and_tiny():
    x = np.array([np.nan, np.inf, -np.inf, 1e30, -7e5, 1e-37, -1e-40, -0.0, 2.0], np.float32)
    got = sanitize_ref(x)
    assert got.tolist() == [0.0, 65504.0, -65504.0, 65504.0, -65504.0, 0.0, 0.0, 0.0, 2.0]
    assert np.signbit(got).tolist() == [False, False, True, False, True, False, True, True, False]


@settings(max_examples=150, deadline=None)
@given(blocks_of_anything)
def test_quantizers_apply_the_policy_and_stay_finite(x):
    codes, scales = quantize_int8_ref(x)
    assert np.isfinite(scales).all()
    assert (as_bits(codes) == as_bits(quantize_int8_ref(sanitize_ref(x))[0])).all()
    assert np.isfinite(dequantize_q4_0_ref(quantize_q4_0_ref(x))).all()


# ---- error bounds --------------------------------------------------------------------------
# Inputs are finite and within fp16's range: the policy is the identity there, except for
# the flush of |x| < 2^-120, which moves a value by less than any bound below.
finite_rows = arrays(np.float32, st.tuples(st.integers(1, 3), st.just(64)),
                     elements=st.floats(-65504, 65504, width=32, allow_subnormal=True))
finite_rows_scaled = st.builds(lambda x, e: x * np.float32(2.0**e), finite_rows, st.integers(-40, 0))


@settings(max_examples=200, deadline=None)
@given(st.one_of(finite_rows, finite_rows_scaled))
def test_int8_error_is_at_most_half_a_step(x):
    """|x - x'| <= s/2 with s the stored scale. Rounding max|x|/127 to fp16 can lower s
    so that max|x| / s > 127 and the code clamps: that adds max|x| - 127 s (nonzero only
    where s is an fp16 subnormal, or 0 when max|x| is below fp16's range). The 2^-15
    covers x / s rounding in float32 (<= 127.5 * 2^-24 of a step) onto a .5 boundary."""
    codes, scales = quantize_int8_ref(x)
    err = np.abs(x - dequantize_int8_ref(codes, scales))  # (rows, 64)
    s = scales.astype(np.float32)  # (rows, 1)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    bound = s / 2 * (1 + 2.0**-15) + np.maximum(0, amax - 127 * s)
    assert (err <= bound).all()


@settings(max_examples=200, deadline=None)
@given(st.one_of(finite_rows, finite_rows_scaled, blocks_with_ties))
def test_q4_0_error_is_at_most_one_step(x):
    """With d = big / -8 (float32): x / d lies in [-8, 8] and rounds half up to q - 8 in
    [-8, 7], so |x - (q - 8) d| <= d/2, except x = -big, which lands on 7d: an error of
    |d|. Storing d as fp16 moves each of the 8 possible steps by <= 2^-11 |d| (normal)
    or 2^-25 (subnormal): |x - x'| <= |d| (1 + 2^-8) + 2^-22."""
    err = np.abs(x - dequantize_q4_0_ref(quantize_q4_0_ref(x))).reshape(-1, 32)
    blocks = x.reshape(-1, 32)
    big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[:, None], axis=-1)
    d = np.abs(big / np.float32(-8))
    assert (err <= d * (1 + 2.0**-8) + 2.0**-22).all()


@pytest.mark.parametrize("quantize", [quantize_int8_ref, quantize_q4_0_ref])
def test_zero_rows_quantize_to_zero(quantize):
    x = np.zeros((2, 64), np.float32)
    out = quantize(x)
    deq = dequantize_int8_ref(*out) if quantize is quantize_int8_ref else dequantize_q4_0_ref(out)
    assert not deq.any()


def test_inf_dequantizes_near_fp16_max():
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1] = np.inf, -np.inf
    deq8 = dequantize_int8_ref(*quantize_int8_ref(x))
    deq4 = dequantize_q4_0_ref(quantize_q4_0_ref(x))
    assert abs(deq8[0, 0] - F16_MAX) <= F16_MAX / 127 / 2 and deq8[0, 1] == -deq8[0, 0]
    assert abs(abs(deq4[0, 0]) - F16_MAX) <= F16_MAX / 8 and np.isfinite(deq4).all()
