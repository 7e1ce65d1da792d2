"""int8 KV quantization: one fp16 scale per 64 values (docs/design.md, "KV cells, blocks, formats").

    scale = fp16(max|x| / 127)
    code  = clamp(rint(x / float32(scale)), -127, 127)     computed against the STORED scale
    x'    = code * scale                                    in float32

Dividing by the stored fp16 scale, not the float32 quotient it was rounded from, picks
the codes for the scale a reader will actually multiply by.

Values that are not ordinary (the policy, shared with q4_0, applied to every input value
before anything else, in the kernel and the reference alike):
- NaN becomes 0: a NaN in one value would otherwise poison the scale of all 64.
- +-inf and finite values beyond +-65504 (the largest fp16) are clamped to +-65504, so a
  scale never overflows to inf (65504 / 127 and 65504 / 8 are both fine in fp16).
- Values with |x| < 2^-120 become a zero of the same sign (as flush-to-zero hardware does
  with denormals). They are far below fp16's smallest step (6e-8), so they dequantize to 0
  either way; flushing them keeps q4_0's 1/d finite (see quant_q4_0.py).
Rounding is half to even: np.rint in the reference, round() (llrintf) in the kernel.
A scale of 0 (an all-zero group, or max|x| below fp16's range) gives codes 0.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32
from numba.core.types import float16

from strata_nb.gpu.launch import DeviceArgs, device_empty, grid_for, is_host_numpy
from strata_nb.gpu.reduce import warp_max
from strata_nb.kv_layout import INT8_GROUP

F16_MAX = np.float32(65504.0)  # the largest finite fp16
TINY = np.float32(2.0**-120)  # below this, a value is flushed to zero
LEVELS = np.float32(127.0)  # codes use -127..127: symmetric, -128 is never produced


# --8<-- [start:sanitize]
def sanitize_ref(x):
    """The non-finite/huge/tiny policy above, on a float32 array."""
    x = np.nan_to_num(np.asarray(x, np.float32), nan=0.0, posinf=F16_MAX, neginf=-F16_MAX)
    x = np.clip(x, -F16_MAX, F16_MAX)
    return np.where(np.abs(x) < TINY, x * np.float32(0.0), x)  # x * 0 keeps the sign


@cuda.jit(device=True)
def sanitize(x):
    """One float32 value through the same policy."""
    if x != x:  # only NaN is unequal to itself
        return float32(0.0)
    if x > F16_MAX:
        return F16_MAX
    if x < -F16_MAX:
        return -F16_MAX
    if abs(x) < TINY:
        return x * float32(0.0)
    return x
# --8<-- [end:sanitize]


# --8<-- [start:quantize_int8_ref]
def quantize_int8_ref(x):
    """x: (..., 64k) float32 -> codes (..., 64k) int8, scales (..., k) float16."""
    assert x.shape[-1] % INT8_GROUP == 0, f"last axis {x.shape[-1]} is not a multiple of {INT8_GROUP}"
    groups = sanitize_ref(x).reshape(*x.shape[:-1], -1, INT8_GROUP)  # (..., k, 64)
    scales = (np.abs(groups).max(axis=-1) / LEVELS).astype(np.float16)  # (..., k)
    stored = scales.astype(np.float32)[..., None]  # the value a reader will multiply by
    with np.errstate(divide="ignore", invalid="ignore"):  # scale 0 is handled just below
        codes = np.clip(np.rint(groups / stored), -127, 127)
    codes = np.where(stored == 0, 0, codes).astype(np.int8)
    return codes.reshape(x.shape), scales


def dequantize_int8_ref(codes, scales):
    """codes (..., 64k) int8, scales (..., k) float16 -> (..., 64k) float32."""
    groups = codes.reshape(*codes.shape[:-1], -1, INT8_GROUP).astype(np.float32)
    return (groups * scales.astype(np.float32)[..., None]).reshape(codes.shape)
# --8<-- [end:quantize_int8_ref]


# --8<-- [start:quantize_int8_device]
@cuda.jit(device=True)
def quantize_int8_group(x,       # (head_dim,) float32: one head row
                        codes,   # (head_dim,) int8, written at group g
                        scales,  # (head_dim // 64,) float16, written at g
                        g):      # which 64-value group of the row
    base = g * INT8_GROUP
    vals = cuda.local.array(INT8_GROUP, float32)  # the group, read once: 64 loads in flight together
    amax = float32(0.0)
    for j in range(INT8_GROUP):
        vals[j] = sanitize(x[base + j])
        amax = max(amax, abs(vals[j]))
    scales[g] = amax / LEVELS  # float32 -> fp16, round to nearest even, as astype(float16)
    stored = float32(scales[g])  # read back: codes are computed against the stored scale
    for j in range(INT8_GROUP):
        codes[base + j] = int8_code(vals[j], stored)


@cuda.jit(device=True)
def int8_code(v, stored):
    """The code of one sanitized value against the stored scale."""
    if stored == 0:
        return 0
    return min(127, max(-127, round(v / stored)))  # round: half to even (llrintf)


@cuda.jit(device=True)
def quantize_int8_pair(x,     # (head_dim,) float32: one head row
                       g,     # which 64-value group of the row
                       lane):  # this lane of the warp that quantizes the group
    """A warp quantizes one group: lane l takes values 2l and 2l + 1, the warp's max|x| is
    one warp_max (a max, so its order cannot change it). Returns the lane's two codes and
    the group's fp16 scale; every lane of the warp must call it together."""
    j = g * INT8_GROUP + 2 * lane
    v0, v1 = sanitize(x[j]), sanitize(x[j + 1])
    scale = float16(warp_max(max(abs(v0), abs(v1))) / LEVELS)  # round to nearest even, as astype
    stored = float32(scale)
    return int8_code(v0, stored), int8_code(v1, stored), scale


@cuda.jit(device=True)
def dequantize_int8_column(codes,   # (n, n_kv, 16, head_dim) int8: a pool or host copy
                           scales,  # (n, n_kv, 16, head_dim // 64) float16
                           r, h, j,  # block (or slot) r, head h, value j of each row
                           out):    # (16,) float32, written: value j of the 16 cells
    for c in range(out.shape[0]):  # loads only, no stores to shared or global between them
        # A 7-bit code times an 11-bit fp16 significand fits float32's 24 bits: exact.
        out[c] = float32(codes[r, h, c, j]) * float32(scales[r, h, c, j // INT8_GROUP])
# --8<-- [end:quantize_int8_device]


# --8<-- [start:quantize_int8_kernel]
@cuda.jit(cache=True)
def quantize_int8_kernel(x,       # (rows, 64k) float32
                         codes,   # (rows, 64k) int8, written
                         scales):  # (rows, k) float16, written
    lane = cuda.grid(1)  # one thread per (row, group): groups are independent
    groups_per_row = scales.shape[1]
    if lane < x.shape[0] * groups_per_row:
        r = lane // groups_per_row
        quantize_int8_group(x[r], codes[r], scales[r], lane % groups_per_row)
# --8<-- [end:quantize_int8_kernel]


def quantize_int8(x):
    """Like quantize_int8_ref. x: (..., 64k) float32, NumPy or device; returns the same kind."""
    *lead, width = x.shape  # not x.shape[-1]: the simulator's device shapes refuse index -1
    assert x.dtype == np.float32, f"x is {x.dtype}, want float32"
    assert width % INT8_GROUP == 0, f"last axis {width} is not a multiple of {INT8_GROUP}"
    groups, n_rows = width // INT8_GROUP, int(np.prod(lead))
    alloc = np.empty if is_host_numpy(x) else device_empty
    codes, scales = alloc(x.shape, np.int8), alloc((*lead, groups), np.float16)
    if n_rows * groups == 0:
        return codes, scales
    with DeviceArgs() as dev:
        quantize_int8_kernel[grid_for(n_rows * groups)](
            dev.read(x).reshape(n_rows, width),
            dev.write(codes).reshape(n_rows, width),
            dev.write(scales).reshape(n_rows, groups))
    return codes, scales
