"""The GGUF weight rows every dense kernel reads, and the device dequantizers that turn them
into float32 on the way: matvec.py and matvec_fused.py (decode), matmul.py (prefill) and
embed.py (token rows) all call them.

A row of W is stored as GGUF stores it: blocks of QK = 32 values, each block its scale(s)
and its codes (BLOCK_BYTES per block); F16 and F32 rows are cut into 32-value blocks too.
A kernel hands each lane a *part*, 8 of a block's 32 values (PART), so 4 neighbouring
lanes (PARTS) cover one block and a warp's loads fall on one contiguous run of the row
(coalesced).

The dequantizers are small device functions with one signature, `part(a, b, row, blk, p,
w)`: a and b are two views of a matrix's weight rows (see QTYPES), row the row, blk the
32-value block, p the part (0..3), and w the part's 8 values, written. Each is its two
steps, `fetch_*` (the loads) and `decode_*` (the arithmetic), which a kernel that reads
several rows in one trip calls apart. Dequantization is exact in float32 (a 4- or 8-bit
code times an fp16 scale fits in 24 bits; Q4_1's `+ m` rounds once, fused or not), so a
kernel and its reference (model/dequant.py's `dequantize`) multiply the same weights.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32

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


# Each dequantizer in two steps: fetch_* loads part p's bytes of a row into row j of two
# small per-thread arrays (its scales or values as float32 into f[j], its codes as 32-bit
# words into c[j]: at most PART and CODES of them), and decode_* makes the part's 8 values
# from them. A kernel that reads several rows' parts in one trip fetches them all before
# it decodes any: the compiler keeps a load that comes after arithmetic on an earlier
# load's value after it, so a thread whose loads and arithmetic alternate waits on memory
# once a row, where one whose loads all come first waits once a trip. `part` below is the
# two steps together, for one row.
CODES = 4  # code words a part fetches, at most


@cuda.jit(device=True)
def fetch_q4_0(a,    # (rows, in/32 * 9) uint16; a row's block blk = d, then 8 halves of codes
               b,    # (rows, in/32 * 9) float16: the same bytes
               row, blk, p, f, c, j):
    f[j, 0] = float32(b[row, 9 * blk])
    for h in range(2):
        c[j, h] = a[row, 9 * blk + 1 + 2 * p + h]  # code bytes 4p + 2h and 4p + 2h + 1


@cuda.jit(device=True)
def decode_q4_0(f, c, j, w):
    d = f[j, 0]
    for h in range(2):
        for i in range(2):
            byte = (c[j, h] >> (8 * i)) & 0xFF
            k = 2 * h + i
            # Subtract in float32 (exact for 0..15): an unsigned code minus 8 would wrap.
            w[k] = (float32(byte & 0x0F) - float32(8.0)) * d
            w[4 + k] = (float32(byte >> 4) - float32(8.0)) * d


@cuda.jit(device=True)
def fetch_q4_1(a,    # (rows, in/32 * 5) uint32; a row's block blk = (d, m), then 4 words of codes
               b,    # (rows, in/32 * 10) float16: the same bytes
               row, blk, p, f, c, j):
    f[j, 0], f[j, 1] = float32(b[row, 10 * blk]), float32(b[row, 10 * blk + 1])
    c[j, 0] = a[row, 5 * blk + 1 + p]  # code bytes 4p..4p+3, one 4-byte load


@cuda.jit(device=True)
def decode_q4_1(f, c, j, w):
    d, m, word = f[j, 0], f[j, 1], c[j, 0]
    for i in range(4):
        byte = (word >> (8 * i)) & 0xFF
        w[i] = float32(byte & 0x0F) * d + m
        w[4 + i] = float32(byte >> 4) * d + m


@cuda.jit(device=True)
def fetch_q8_0(a,    # (rows, in/32 * 17) int16; a row's block blk = d, then 16 pairs of int8 codes
               b,    # (rows, in/32 * 17) float16: the same bytes
               row, blk, p, f, c, j):
    f[j, 0] = float32(b[row, 17 * blk])
    for h in range(4):  # code bytes 8p + 2h (the low byte) and 8p + 2h + 1 (the high byte)
        c[j, h] = a[row, 17 * blk + 1 + 4 * p + h]


@cuda.jit(device=True)
def decode_q8_0(f, c, j, w):
    d = f[j, 0]
    for h in range(4):
        # the pair's 16 bits at the top of 64: shifts bring out each int8 with its sign,
        # with no compare
        pair = int64(c[j, h]) << 48
        w[2 * h] = float32((pair << 8) >> 56) * d
        w[2 * h + 1] = float32(pair >> 56) * d


@cuda.jit(device=True)
def fetch_f16(a,    # (rows, in) float16
              b,    # unused (the same array)
              row, blk, p, f, c, j):
    for k in range(PART):
        f[j, k] = float32(a[row, QK * blk + PART * p + k])


@cuda.jit(device=True)
def fetch_f32(a,    # (rows, in) float32
              b,    # unused (the same array)
              row, blk, p, f, c, j):
    for k in range(PART):
        f[j, k] = a[row, QK * blk + PART * p + k]


@cuda.jit(device=True)
def decode_float(f, c, j, w):
    for k in range(PART):
        w[k] = f[j, k]


def make_part(fetch, decode, name: str):
    """The dequantizer `part(a, b, row, blk, p, w)`: part p of block blk of row `row` of
    (a, b), its 8 values into w; the two steps above, for one row. `name` names it (the
    PTX checks tell kernels apart by the device functions they were made from)."""

    def part(a, b, row, blk, p, w):
        f = cuda.local.array((1, PART), float32)
        c = cuda.local.array((1, CODES), uint32)
        fetch(a, b, row, blk, p, f, c, 0)
        decode(f, c, 0, w)

    part.__name__ = part.__qualname__ = name
    return cuda.jit(device=True)(part)


part_q4_0 = make_part(fetch_q4_0, decode_q4_0, "part_q4_0")
part_q4_1 = make_part(fetch_q4_1, decode_q4_1, "part_q4_1")
part_q8_0 = make_part(fetch_q8_0, decode_q8_0, "part_q8_0")
part_f16 = make_part(fetch_f16, decode_float, "part_f16")
part_f32 = make_part(fetch_f32, decode_float, "part_f32")


# qtype: (dequantizer, view a, view b, 4-bit nibble layout)
QTYPES = {
    "Q4_0": (part_q4_0, np.uint16, np.float16, True),
    "Q4_1": (part_q4_1, np.uint32, np.float16, True),
    "Q8_0": (part_q8_0, np.int16, np.float16, False),
    "F16": (part_f16, np.float16, np.float16, False),
    "F32": (part_f32, np.float32, np.float32, False),
}
# qtype: its dequantizer's two steps, fetch and decode
STEPS = {"Q4_0": (fetch_q4_0, decode_q4_0), "Q4_1": (fetch_q4_1, decode_q4_1), "Q8_0": (fetch_q8_0, decode_q8_0),
         "F16": (fetch_f16, decode_float), "F32": (fetch_f32, decode_float)}
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
