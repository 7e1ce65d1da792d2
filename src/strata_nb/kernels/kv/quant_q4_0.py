"""q4_0 KV quantization: ggml's block_q4_0, byte for byte (docs/design.md, "KV cells, blocks,
formats").

One block is 32 values in 18 bytes: fp16 `d` (little-endian, bytes 0-1), then 16 bytes
of 4-bit codes; value j sits in the low nibble of byte j, value j + 16 in the high one.

    big = the value of largest |x| (with its sign; the first of equals wins, as np.argmax)
    d   = big / -8,   id = 1 / d  (0 when d == 0)
    q   = clamp(trunc(x * id + 8.5), 0, 15)
    x'  = (q - 8) * fp16(d)

Dividing by -8 rather than 8 maps `big` itself to code 0 (-8 after the offset), so the
lone extreme uses the side of the 16 levels that has one more step. The operations are
gguf's (`gguf.quants.Q4_0.quantize_blocks`) in the same float32 order, so the bytes equal
`gguf.quants.quantize(x, GGMLQuantizationType.Q4_0)`.

Inputs go through quant_int8's policy first (NaN -> 0, clamp to +-65504, |x| < 2^-120 ->
a zero of the same sign). The flush is what keeps `id` finite: without it a block whose
largest value is below 8 / float32-max (2.4e-38) gets 1 / d = inf, and x * inf is NaN
or inf, which NumPy and the GPU turn into different codes. So the bytes equal gguf's on
`sanitize_ref(x)`, and on x itself whenever the policy leaves x unchanged.

The kernel writes `d` through a float16 view of the same bytes: every block starts at an
even byte, so block g's d is element 9 * g of the view.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from numba.core.types import float16

from strata_nb.gpu.launch import DeviceArgs, device_empty, grid_for, is_host_numpy
from strata_nb.gpu.rounding import mul_rn
from strata_nb.gpu.warp_rows import largest_and_across
from strata_nb.kernels.kv.quant_int8 import sanitize, sanitize_ref
from strata_nb.kv_layout import Q4_BYTES, Q4_GROUP

HALF = Q4_GROUP // 2  # 16: value j and value j + 16 share byte j
D_STRIDE = Q4_BYTES // 2  # 9: float16 elements per block, d being the first


# --8<-- [start:quantize_q4_0_ref]
def quantize_q4_0_ref(x):
    """x: (..., 32k) float32 -> (..., 18k) uint8, k block_q4_0 per row."""
    assert x.shape[-1] % Q4_GROUP == 0, f"last axis {x.shape[-1]} is not a multiple of {Q4_GROUP}"
    blocks = sanitize_ref(x).reshape(-1, Q4_GROUP)  # (n, 32)
    first_max = np.abs(blocks).argmax(axis=-1)[:, None]  # argmax takes the first of equals
    big = np.take_along_axis(blocks, first_max, axis=-1)  # (n, 1), with its sign
    d = big / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc(blocks * inv_d + np.float32(8.5)).clip(0, 15).astype(np.uint8)
    nibbles = q[:, :HALF] | (q[:, HALF:] << np.uint8(4))  # (n, 16)
    d_bytes = d.astype("<f2").view(np.uint8)  # (n, 2) little-endian fp16
    return np.concatenate([d_bytes, nibbles], axis=-1).reshape(*x.shape[:-1], -1)


def dequantize_q4_0_ref(q4):
    """q4: (..., 18k) uint8 -> (..., 32k) float32."""
    blocks = q4.reshape(-1, Q4_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # (n, 1)
    nibbles = blocks[:, 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)  # (n, 32)
    return ((q - 8) * d).reshape(*q4.shape[:-1], -1)  # exact: 4-bit code x fp16 d
# --8<-- [end:quantize_q4_0_ref]


# --8<-- [start:quantize_q4_0_device]
@cuda.jit(device=True)
def q4_code(x, inv_d):
    """One value's 4-bit code; x is already sanitized. Adding 8.5 and truncating rounds
    x / d half up and shifts -8..8 to 0..16 (16, only reached by -big, clamps to 15).
    mul_rn: a multiply never fused with the add (gpu/rounding.py), as gguf's NumPy rounds
    twice."""
    y = mul_rn(x, inv_d) + float32(8.5)
    return min(15, max(0, int(y)))  # int() truncates toward zero, like np.trunc


@cuda.jit(device=True)
def quantize_q4_0_group(x,     # (head_dim,) float32: one head row
                        q4,    # (head_dim // 32 * 18,) uint8, block g written
                        q4_d,  # (head_dim // 32 * 9,) float16: the same bytes as q4
                        g):    # which 32-value block of the row
    base = g * Q4_GROUP
    vals = cuda.local.array(Q4_GROUP, float32)  # the block, read once: 32 loads in flight together
    for j in range(Q4_GROUP):
        vals[j] = sanitize(x[base + j])
    big = vals[0]
    for j in range(1, Q4_GROUP):
        if abs(vals[j]) > abs(big):  # strictly greater: the first of equals stays, as argmax
            big = vals[j]
    d = big / float32(-8.0)
    inv_d = float32(1.0) / d if d != 0 else float32(0.0)
    q4_d[g * D_STRIDE] = d  # float32 -> fp16, round to nearest even, as astype(float16)
    for j in range(HALF):
        low = q4_code(vals[j], inv_d)
        high = q4_code(vals[j + HALF], inv_d)
        q4[g * Q4_BYTES + 2 + j] = low | (high << 4)


@cuda.jit(device=True)
def quantize_q4_0_warp(v,      # this lane's value of the 32-value block: lane l holds value l
                       lane):  # this lane of the warp that quantizes the block
    """A warp quantizes one block it holds, a value a lane. Returns the lane's code byte
    (for lanes 0..15: value l in the low nibble, value l + 16 in the high one; the other
    lanes' is unused) and the block's fp16 d. Every lane of the warp must call it
    together: `big` and the value 16 lanes on come from the other lanes (gpu/warp_rows.py)."""
    v = sanitize(v)
    big, across = largest_and_across(v, lane)  # big: the first of equals, as argmax
    d = big / float32(-8.0)
    inv_d = float32(1.0) / d if d != 0 else float32(0.0)
    high = q4_code(across, inv_d)
    return q4_code(v, inv_d) | (high << 4), float16(d)  # float32 -> fp16, round to nearest even


@cuda.jit(device=True)
def dequantize_q4_0_column(q4,    # (n, n_kv, 16, head_dim // 32 * 18) uint8: a pool or host copy
                           q4_d,  # the same bytes as float16
                           r, h, j,  # block (or slot) r, head h, value j of each row
                           out):  # (16,) float32, written: value j of the 16 cells
    # value j is the low nibble of byte j % 16 of its group in the first half of the
    # group, the high nibble in the second
    g, w = j // Q4_GROUP, j % Q4_GROUP
    at, high = g * Q4_BYTES + 2 + w % HALF, w >= HALF
    for c in range(out.shape[0]):
        byte = q4[r, h, c, at]
        nibble = byte >> 4 if high else byte & 0x0F
        # Subtract in float32 (exact for 0..15): a uint8 minus 8 would wrap around.
        out[c] = (float32(nibble) - float32(8.0)) * float32(q4_d[r, h, c, g * D_STRIDE])
# --8<-- [end:quantize_q4_0_device]


# --8<-- [start:quantize_q4_0_kernel]
@cuda.jit(cache=True)
def quantize_q4_0_kernel(x,     # (rows, 32k) float32
                         q4,    # (rows, 18k) uint8, written
                         q4_d):  # (rows, 9k) float16: the same bytes as q4
    lane = cuda.grid(1)  # one thread per (row, block): blocks are independent
    blocks_per_row = x.shape[1] // Q4_GROUP
    if lane < x.shape[0] * blocks_per_row:
        r = lane // blocks_per_row
        quantize_q4_0_group(x[r], q4[r], q4_d[r], lane % blocks_per_row)
# --8<-- [end:quantize_q4_0_kernel]


def quantize_q4_0(x):
    """Like quantize_q4_0_ref. x: (..., 32k) float32, NumPy or device; returns the same kind."""
    *lead, width = x.shape  # not x.shape[-1]: the simulator's device shapes refuse index -1
    assert x.dtype == np.float32, f"x is {x.dtype}, want float32"
    assert width % Q4_GROUP == 0, f"last axis {width} is not a multiple of {Q4_GROUP}"
    n_blocks, n_rows = width // Q4_GROUP, int(np.prod(lead))
    shape = (*lead, n_blocks * Q4_BYTES)
    q4 = np.empty(shape, np.uint8) if is_host_numpy(x) else device_empty(shape, np.uint8)
    if n_rows * n_blocks == 0:
        return q4
    with DeviceArgs() as dev:
        rows = dev.write(q4).reshape(n_rows, n_blocks * Q4_BYTES)
        quantize_q4_0_kernel[grid_for(n_rows * n_blocks)](
            dev.read(x).reshape(n_rows, width), rows, rows.view(np.float16))
    return q4
