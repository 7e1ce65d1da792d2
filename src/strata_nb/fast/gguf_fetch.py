"""Plain twins: kernels/dense/gguf_rows.py's dequantizers (part_q4_0, ...). Each here is cut
in two steps, the loads and the arithmetic, so a kernel that reads several rows in one trip
can send every row's loads before it decodes any (the expert kernels), and a part's own
loads all go out before its arithmetic (the fast dense kernels, through QTYPES below).

fetch_* loads part p's bytes of a row into row j of two small per-thread arrays (its
scales or values as float32 into f[j], its codes as 32-bit words into c[j]: at most PART
and CODES of them), and decode_* makes the part's 8 values from them. The compiler keeps
a load that comes after arithmetic on an earlier load's value after it, so a thread whose
loads and arithmetic alternate waits on memory once a row, where one whose loads all come
first waits once a trip. decode(fetch(...)) is the plain part(...) bit for bit
(tests/kernels/test_dense_kernels.py); the instructions differ in order.
"""
from __future__ import annotations

from numba import cuda, float32, int64, uint32

from strata_nb.kernels.dense import gguf_rows
from strata_nb.kernels.dense.gguf_rows import PART, QK

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


# --8<-- [start:fetch_q4_1]
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
# --8<-- [end:fetch_q4_1]


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


def fetch_whole(part, name: str):
    """A dequantizer not cut in two yet (Q5_0, Q5_1 and the K-quants): the plain `part`
    whole as the fetch step, its 8 values into f[j] (decode_float copies them out). Its
    loads and arithmetic still alternate; bit for bit the plain part, being it."""

    def fetch(a, b, row, blk, p, f, c, j):
        w = cuda.local.array(PART, float32)
        part(a, b, row, blk, p, w)
        for k in range(PART):
            f[j, k] = w[k]

    fetch.__name__ = fetch.__qualname__ = name
    return cuda.jit(device=True)(fetch)


# qtype: its dequantizer's two steps, fetch and decode
STEPS = {"Q4_0": (fetch_q4_0, decode_q4_0), "Q4_1": (fetch_q4_1, decode_q4_1), "Q8_0": (fetch_q8_0, decode_q8_0),
         "F16": (fetch_f16, decode_float), "F32": (fetch_f32, decode_float)}
WHOLE = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # the types read through fetch_whole
STEPS |= {qtype: (fetch_whole(gguf_rows.QTYPES[qtype][0], f"fetch_{qtype.lower()}_whole"), decode_float)
          for qtype in WHOLE}


def make_part(fetch, decode, name: str):
    """The dequantizer `part(a, b, row, blk, p, w)` (gguf_rows.py's signature) as the two
    steps above, for one row. `name` names it (the PTX checks tell kernels apart by the
    device functions they were made from)."""

    def part(a, b, row, blk, p, w):
        f = cuda.local.array((1, PART), float32)
        c = cuda.local.array((1, CODES), uint32)
        fetch(a, b, row, blk, p, f, c, 0)
        decode(f, c, 0, w)

    part.__name__ = part.__qualname__ = name
    return cuda.jit(device=True)(part)


# gguf_rows.QTYPES with each dequantizer made from its two steps: what the fast dense
# kernels dequantize with
QTYPES = {qtype: (make_part(*STEPS[qtype], f"part_{qtype.lower()}"), view_a, view_b, nibbles)
          for qtype, (_, view_a, view_b, nibbles) in gguf_rows.QTYPES.items() if qtype in STEPS}
