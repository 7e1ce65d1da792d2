"""The GGUF weight rows every dense kernel reads, and the device dequantizers that turn them
into float32 on the way: matvec.py (decode), matmul.py (prefill) and embed.py (token rows)
all call them.

A row of W is stored as GGUF stores it: blocks of QK = 32 values, each block its scale(s)
and its codes (BLOCK_BYTES per block); F16 and F32 rows are cut into 32-value blocks too.
A kernel hands each lane a *part*, 8 of a block's 32 values (PART), so 4 neighbouring
lanes (PARTS) cover one block and a warp's loads fall on one contiguous run of the row
(coalesced).

The dequantizers are small device functions with one signature, `part(a, b, row, blk, p,
w)`: a and b are two views of a matrix's weight rows (see QTYPES), row the row, blk the
32-value block, p the part (0..3), and w the part's 8 values, written. Dequantization is
exact in float32 (a 4- or 8-bit code times an fp16 scale fits in 24 bits; Q4_1's `+ m`
rounds once, fused or not), so a kernel and its reference (model/dequant.py's
`dequantize`) multiply the same weights.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, int64, uint32

QK = 32  # values per quantization block; F16/F32 rows are cut into 32-value blocks too
PARTS = 4  # lanes per block
PART = QK // PARTS  # 8 values per lane per block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "F32": 128, "Q5_0": 22, "Q5_1": 24}  # bytes per 32 values
QK_K = 256  # values per K-quant super-block: its 8 blocks of 32 share one run of bytes
SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per 256 values


# --8<-- [start:dequant_parts]
# Part p of block blk: w[0..8] are 8 of the block's 32 values, as two runs of 4. In the
# 4-bit formats byte j holds value j (low nibble) and value j + 16 (high nibble), so a
# lane that reads code bytes 4p..4p+3 gets values 4p..4p+3 and 16+4p..16+4p+3; in the
# others it gets values 8p..8p+7.
@cuda.jit(device=True)
def part_runs(nibbles, p):
    """Where w[0:4] and w[4:8] of part p start in their 32-value block."""
    if nibbles:
        return 4 * p, 16 + 4 * p
    return PART * p, PART * p + 4


@cuda.jit(device=True)
def part_q4_0(a,    # (rows, in/32 * 9) uint16; a row's block blk = d, then 8 halves of codes
              b,    # (rows, in/32 * 9) float16: the same bytes
              row, blk, p, w):
    d = float32(b[row, 9 * blk])
    for h in range(2):
        codes = a[row, 9 * blk + 1 + 2 * p + h]  # code bytes 4p + 2h and 4p + 2h + 1
        for i in range(2):
            byte = (codes >> (8 * i)) & 0xFF
            k = 2 * h + i
            # Subtract in float32 (exact for 0..15): an unsigned code minus 8 would wrap.
            w[k] = (float32(byte & 0x0F) - float32(8.0)) * d
            w[4 + k] = (float32(byte >> 4) - float32(8.0)) * d


# --8<-- [start:part_q4_1]
@cuda.jit(device=True)
def part_q4_1(a,    # (rows, in/32 * 5) uint32; a row's block blk = (d, m), then 4 words of codes
              b,    # (rows, in/32 * 10) float16: the same bytes
              row, blk, p, w):
    d, m = float32(b[row, 10 * blk]), float32(b[row, 10 * blk + 1])
    word = a[row, 5 * blk + 1 + p]  # code bytes 4p..4p+3, one 4-byte load
    for i in range(4):
        byte = (word >> (8 * i)) & 0xFF
        w[i] = float32(byte & 0x0F) * d + m
        w[4 + i] = float32(byte >> 4) * d + m
# --8<-- [end:part_q4_1]


@cuda.jit(device=True)
def part_q8_0(a,    # (rows, in/32 * 17) int16; a row's block blk = d, then 16 pairs of int8 codes
              b,    # (rows, in/32 * 17) float16: the same bytes
              row, blk, p, w):
    d = float32(b[row, 17 * blk])
    for h in range(4):  # code bytes 8p + 2h (the low byte) and 8p + 2h + 1 (the high byte)
        # the pair's 16 bits at the top of 64: shifts bring out each int8 with its sign,
        # with no compare
        pair = int64(a[row, 17 * blk + 1 + 4 * p + h]) << 48
        w[2 * h] = float32((pair << 8) >> 56) * d
        w[2 * h + 1] = float32(pair >> 56) * d


@cuda.jit(device=True)
def part_f16(a,    # (rows, in) float16
             b,    # unused (the same array)
             row, blk, p, w):
    for k in range(PART):
        w[k] = float32(a[row, QK * blk + PART * p + k])


@cuda.jit(device=True)
def part_f32(a,    # (rows, in) float32
             b,    # unused (the same array)
             row, blk, p, w):
    for k in range(PART):
        w[k] = a[row, QK * blk + PART * p + k]


@cuda.jit(device=True)
def part_q5_0(a,    # (rows, in/32 * 11) uint16; a row's block blk = d, qh (2 halves), then 8 halves of codes
              b,    # (rows, in/32 * 11) float16: the same bytes
              row, blk, p, w):
    d = float32(b[row, 11 * blk])
    qh = uint32(a[row, 11 * blk + 1]) | (uint32(a[row, 11 * blk + 2]) << 16)  # bit j: value j's fifth bit
    for h in range(2):
        codes = a[row, 11 * blk + 3 + 2 * p + h]  # code bytes 4p + 2h and 4p + 2h + 1
        for i in range(2):
            byte = (codes >> (8 * i)) & 0xFF
            k = 2 * h + i
            j = 4 * p + k  # the low nibble's value; the high nibble's is j + 16
            low = (byte & 0x0F) | (((qh >> j) & 1) << 4)
            high = (byte >> 4) | (((qh >> (j + 16)) & 1) << 4)
            w[k] = (float32(low) - float32(16.0)) * d
            w[4 + k] = (float32(high) - float32(16.0)) * d


@cuda.jit(device=True)
def part_q5_1(a,    # (rows, in/32 * 6) uint32; a row's block blk = (d, m), qh, then 4 words of codes
              b,    # (rows, in/32 * 12) float16: the same bytes
              row, blk, p, w):
    d, m = float32(b[row, 12 * blk]), float32(b[row, 12 * blk + 1])
    qh = a[row, 6 * blk + 1]  # bit j: value j's fifth bit
    word = a[row, 6 * blk + 2 + p]  # code bytes 4p..4p+3, one 4-byte load
    for i in range(4):
        byte = (word >> (8 * i)) & 0xFF
        j = 4 * p + i  # the low nibble's value; the high nibble's is j + 16
        w[i] = float32((byte & 0x0F) | (((qh >> j) & 1) << 4)) * d + m
        w[4 + i] = float32((byte >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m


# --8<-- [start:part_k_quants]
# The K-quants: block blk is sub-block blk % 8 of super-block blk // 8 (256 values), and
# part p is its values 8p..8p+7 (no nibble runs: a sub-block's value i is byte i's low or
# high nibble). A sub-block's scale is exact in float32 (an fp16 d times a 6- or 8-bit
# integer), and so is its product with a 4- or 5-bit code: `- low` rounds once, fused or
# not, as in Q4_1.
@cuda.jit(device=True)
def scale_byte(a, row, at, k):
    """Byte k of the 12 scale bytes that start at word `at` of a uint32 row."""
    return (a[row, at + k // 4] >> (8 * (k % 4))) & 0xFF


@cuda.jit(device=True)
def scale_min_k4(a, row, at, j):
    """Sub-block j's 6-bit scale and min (model/dequant.py's scale_min_k4, one at a time)."""
    if j < 4:
        return scale_byte(a, row, at, j) & 63, scale_byte(a, row, at, j + 4) & 63
    low4 = scale_byte(a, row, at, j + 4)
    return ((low4 & 15) | ((scale_byte(a, row, at, j - 4) >> 6) << 4),
            (low4 >> 4) | ((scale_byte(a, row, at, j) >> 6) << 4))


@cuda.jit(device=True)
def scale_and_low(a, b, row, sb, j, words):
    """Sub-block j's float32 scale (d * sc) and low (dmin * m), in super-block sb of a row
    of `words` uint32 words a super-block (d and dmin first, then the 12 scale bytes)."""
    sc, m = scale_min_k4(a, row, words * sb + 1, j)
    return float32(b[row, 2 * words * sb]) * float32(sc), float32(b[row, 2 * words * sb + 1]) * float32(m)


@cuda.jit(device=True)
def part_q4_k(a,    # (rows, in/256 * 36) uint32; a super-block = (d, dmin), 3 words of scales, 32 of codes
              b,    # (rows, in/256 * 72) float16: the same bytes
              row, blk, p, w):
    sb, j = blk // 8, blk % 8
    scale, low = scale_and_low(a, b, row, sb, j, 36)
    for h in range(2):
        word = a[row, 36 * sb + 4 + 8 * (j // 2) + 2 * p + h]  # code bytes 8p + 4h .. 8p + 4h + 3
        for i in range(4):
            w[4 * h + i] = scale * float32((word >> (8 * i + 4 * (j % 2))) & 0x0F) - low


@cuda.jit(device=True)
def part_q5_k(a,    # (rows, in/256 * 44) uint32: Q4_K's fields, with 8 words of fifth bits before the codes
              b,    # (rows, in/256 * 88) float16: the same bytes
              row, blk, p, w):
    sb, j = blk // 8, blk % 8
    scale, low = scale_and_low(a, b, row, sb, j, 44)
    for h in range(2):
        word = a[row, 44 * sb + 12 + 8 * (j // 2) + 2 * p + h]
        fifths = a[row, 44 * sb + 4 + 2 * p + h]  # bit j of byte i: value i's fifth bit
        for i in range(4):
            q = ((word >> (8 * i + 4 * (j % 2))) & 0x0F) | (((fifths >> (8 * i + j)) & 1) << 4)
            w[4 * h + i] = scale * float32(q) - low


@cuda.jit(device=True)
def part_q6_k(a,    # (rows, in/256 * 105) uint16; a super-block = 64 halves of low nibbles, 32 of top bits,
              b,    # 8 of int8 scales, d. b: (rows, in/256 * 105) float16, the same bytes
              row, blk, p, w):
    sb, j = blk // 8, blk % 8
    half, r = j // 4, j % 4  # sub-block r of the super-block's half (128 values)
    byte = (a[row, 105 * sb + 96 + j] >> (8 * (p // 2))) & 0xFF  # the scale of values 16(p // 2) ..
    scale = float32(b[row, 105 * sb + 104]) * float32((int32(byte) ^ 128) - 128)  # a signed byte
    for h in range(4):
        lows = a[row, 105 * sb + 32 * half + 16 * (r % 2) + 4 * p + h]  # bytes 8p + 2h, 8p + 2h + 1
        tops = a[row, 105 * sb + 64 + 16 * half + 4 * p + h]
        for i in range(2):
            q = ((lows >> (8 * i + 4 * (r // 2))) & 0x0F) | (((tops >> (8 * i + 2 * r)) & 3) << 4)
            w[2 * h + i] = scale * (float32(q) - float32(32.0))
# --8<-- [end:part_k_quants]


# qtype: (dequantizer, view a, view b, 4-bit nibble layout)
QTYPES = {
    "Q4_0": (part_q4_0, np.uint16, np.float16, True),
    "Q4_1": (part_q4_1, np.uint32, np.float16, True),
    "Q8_0": (part_q8_0, np.int16, np.float16, False),
    "F16": (part_f16, np.float16, np.float16, False),
    "F32": (part_f32, np.float32, np.float32, False),
    "Q5_0": (part_q5_0, np.uint16, np.float16, True),
    "Q5_1": (part_q5_1, np.uint32, np.float16, True),
    "Q4_K": (part_q4_k, np.uint32, np.float16, False),
    "Q5_K": (part_q5_k, np.uint32, np.float16, False),
    "Q6_K": (part_q6_k, np.uint16, np.float16, False),
}
# --8<-- [end:dequant_parts]


def unit(qtype: str) -> tuple[int, int]:
    """(values, bytes) of qtype's unit of storage: a block of 32, or a K-quant's super-block."""
    assert qtype in QTYPES, f"qtype {qtype!r} is not one of {', '.join(QTYPES)}"
    return (QK_K, SUPER_BLOCK_BYTES[qtype]) if qtype in SUPER_BLOCK_BYTES else (QK, BLOCK_BYTES[qtype])


def row_bytes(qtype: str, n_in: int) -> int:
    """Bytes of one GGUF row of `n_in` values; n_in must be whole blocks (super-blocks)."""
    values, nbytes = unit(qtype)
    assert n_in % values == 0, f"row length {n_in} is not a multiple of {values}"
    return n_in // values * nbytes


def row_values(qtype: str, bytes_per_row: int) -> int:
    """Values in one GGUF row of `bytes_per_row` bytes."""
    values, nbytes = unit(qtype)
    assert bytes_per_row % nbytes == 0, f"{bytes_per_row} bytes is not whole {qtype} blocks"
    return bytes_per_row // nbytes * values


def weight_views(raw, qtype: str):
    """The two views of (out, bytes_per_row) uint8 rows that qtype's dequantizer reads."""
    _, view_a, view_b, _ = QTYPES[qtype]
    return raw.view(view_a), raw.view(view_b)
