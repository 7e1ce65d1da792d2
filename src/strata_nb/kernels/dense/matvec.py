"""y = x @ W.T for a few activation rows, W read once in its GGUF quantized form: the decode
hot path (a decode step is 1 row of x, a verify window up to 8).

Index legend: n activation rows (1..8), in = the row length of x and W, out = rows of W.

Read gguf_rows.py first: how a row of W is stored, and the device dequantizers every
dense kernel calls to turn one part of a row into float32. Then this file, top down:
`matvec_ref`, the spec, and its tolerance; `matvec_kernel`, a warp per row of W; and its
launcher `matvec`.

Why this is a bandwidth problem. A decode step multiplies each weight once, so its time
is the time to read the weights (the default model's 92 MiB a token), and arithmetic is
cheap next to that. The kernel is shaped around the reads: a lane handles a *part*, 8 of
the 32 values of a quantization block, so 4 neighbouring lanes cover one block and a
warp's loads fall on one contiguous run of the row (coalesced); every row of x is summed
from that one read of W, so a verify window costs the weight reads of one step.

Tolerance. The kernel and the reference (`x @ dequantize(raw, qtype).T`, float32 BLAS)
sum the same `in` products in different orders: the kernel adds in/32 products per lane
one after another, then a 5-level tree over lanes; BLAS in its own blocked order. Any
float32 summation of k products is within (k + 1) * u * sum_i |x_i w_i| of the exact
value (u = 2^-24; first order, whatever the order), so the two are within
`dot_tolerance` = 2 (in + 1) u sum_i |x_i| |w_i| of each other, output by output. It is
loose (random rounding errors grow like sqrt(k)), and still below what a real bug costs:
one wrong scale moves 32 products, ~32 sum/in, which is 16 / (u in^2) times the bound.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_bytes, weight_views
from strata_nb.model.dequant import dequantize

MAX_ROWS = 8  # activation rows per call: a decode step (1) or a verify window (<= 8)
U = 2.0 ** -24  # float32 unit roundoff


# --8<-- [start:product_ref]
def product_ref(x,  # (n, in) float32
                w):  # (out, in) float32, as GGUF stores W
    """-> x @ w.T, (n, out) float32: the product every reference makes.

    A decode step's or a verify window's rows (n <= MAX_ROWS) are multiplied one at a time.
    BLAS sums a many-row product (gemm) in another order than a one-row one (gemv), and
    which order depends on the library's version; so a window's row would differ from the
    decode step at its position by a rounding, now and then enough to flip a greedy pick.
    One row at a time, a row's sums never depend on the rows beside it, and a window gives
    the decode steps' bits. A prompt chunk's rows (more than MAX_ROWS) are one product."""
    if x.shape[0] > MAX_ROWS:
        return x @ w.T
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    for i in range(x.shape[0]):
        np.matmul(x[i], w.T, out=y[i])
    return y
# --8<-- [end:product_ref]


# --8<-- [start:matvec_ref]
def matvec_ref(x,      # (n, in) float32
               raw,    # (out, bytes_per_row) uint8: GGUF rows of W, (out, in) once dequantized
               qtype,  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
               y):     # (n, out) float32, written
    """y = x @ W.T, W dequantized exactly; nothing fused."""
    y[...] = product_ref(x, dequantize(raw, qtype))


def dot_tolerance(x, w):
    """(n, out) float64: how far kernel and reference may differ (module docstring)."""
    x64, w64 = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    return 2 * (x.shape[1] + 1) * U * (x64 @ w64.T)
# --8<-- [end:matvec_ref]


# --8<-- [start:matvec_kernel]
def make_row_sums(part, nibbles):
    """One lane's share of x @ W[o] for one weight type (its dequantizer `part`): lane l
    dequantizes every 32nd part of row o and adds its products with every row of x into
    acc; a warp_sum of acc then gives the row's dot products. The matvec kernel below and
    the megakernel's products (fast/mega/stages.py) both call it."""

    @cuda.jit(device=True)
    def row_sums(x,     # (n, in) float32, n <= len(acc)
                 n_in,  # int32: the length of a row of W
                 a, b,  # (out, *) views a and b of W's rows (QTYPES)
                 o,     # the row of W
                 lane,  # this lane, 0..31
                 acc):  # (>= n,) float32: this lane's sum for each row of x, added to
        w = cuda.local.array(PART, float32)  # 8 weights of the row, dequantized
        # Lane l takes parts l, l + 32, ...: each round the warp's 32 parts are 8 whole
        # blocks side by side, so its loads fall on one contiguous run of the row.
        for q in range(lane, n_in // PART, WARP):
            blk, p = q // PARTS, q % PARTS
            part(a, b, o, blk, p, w)
            lo, hi = part_runs(nibbles, p)  # the columns of w[0:4] and w[4:8] in the block
            lo, hi = blk * QK + lo, blk * QK + hi
            for r in range(x.shape[0]):
                for j in range(4):
                    acc[r] += w[j] * x[r, lo + j] + w[4 + j] * x[r, hi + j]

    return row_sums


def make_matvec_kernel(row_sums):
    """The kernel for one weight type (its `row_sums`): one warp per row of W."""

    @cuda.jit(cache=True)
    def matvec_kernel(x,     # (n, in) float32, n <= MAX_ROWS
                      n_in,  # int32: the length of a row of W
                      a,     # (out, *) view a of W's rows (QTYPES)
                      b,     # (out, *) view b of the same bytes
                      y):    # (n, out) float32, written
        o = cuda.blockIdx.x  # the row of W; the thread block is one warp
        lane = cuda.threadIdx.x
        acc = cuda.local.array(MAX_ROWS, float32)  # this lane's sum for each row of x
        for r in range(MAX_ROWS):
            acc[r] = float32(0.0)
        row_sums(x, n_in, a, b, o, lane, acc)
        for r in range(x.shape[0]):
            total = warp_sum(acc[r])  # the 32 lanes' sums, in every lane
            if lane == 0:
                y[r, o] = total

    return matvec_kernel


ROW_SUMS = {qtype: make_row_sums(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
MATVEC_KERNELS = {qtype: make_matvec_kernel(row_sums) for qtype, row_sums in ROW_SUMS.items()}
# --8<-- [end:matvec_kernel]


def matvec(x, raw, qtype, y):
    """Like matvec_ref, on the device: a warp per row of W. NumPy arguments are moved (y is
    written back); device arguments are used in place."""
    expect("x", x, np.float32, (None, None))
    n, n_in = x.shape
    assert n <= MAX_ROWS, f"x has {n} rows; matvec takes at most {MAX_ROWS} (use matmul)"
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    if n == 0 or n_out == 0:
        return
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        MATVEC_KERNELS[qtype][n_out, WARP, stream()](dev.read(x), np.int32(n_in), a, b, dev.write(y))
