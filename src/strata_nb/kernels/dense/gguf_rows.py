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
from numba import cuda, float32, int64

QK = 32  # values per quantization block; F16/F32 rows are cut into 32-value blocks too
PARTS = 4  # lanes per block
PART = QK // PARTS  # 8 values per lane per block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "F32": 128}  # bytes per 32 values


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


# qtype: (dequantizer, view a, view b, 4-bit nibble layout)
QTYPES = {
    "Q4_0": (part_q4_0, np.uint16, np.float16, True),
    "Q4_1": (part_q4_1, np.uint32, np.float16, True),
    "Q8_0": (part_q8_0, np.int16, np.float16, False),
    "F16": (part_f16, np.float16, np.float16, False),
    "F32": (part_f32, np.float32, np.float32, False),
}
# --8<-- [end:dequant_parts]


def row_bytes(qtype: str, n_in: int) -> int:
    """Bytes of one GGUF row of `n_in` values; n_in must be a multiple of 32."""
    assert qtype in QTYPES, f"qtype {qtype!r} is not one of {', '.join(QTYPES)}"
    assert n_in % QK == 0, f"row length {n_in} is not a multiple of {QK}"
    return n_in // QK * BLOCK_BYTES[qtype]


def row_values(qtype: str, bytes_per_row: int) -> int:
    """Values in one GGUF row of `bytes_per_row` bytes."""
    assert qtype in QTYPES, f"qtype {qtype!r} is not one of {', '.join(QTYPES)}"
    assert bytes_per_row % BLOCK_BYTES[qtype] == 0, f"{bytes_per_row} bytes is not whole {qtype} blocks"
    return bytes_per_row // BLOCK_BYTES[qtype] * QK


def weight_views(raw, qtype: str):
    """The two views of (out, bytes_per_row) uint8 rows that qtype's dequantizer reads."""
    _, view_a, view_b, _ = QTYPES[qtype]
    return raw.view(view_a), raw.view(view_b)
