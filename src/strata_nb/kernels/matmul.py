"""y = x @ W.T for many activation rows (a prompt chunk), W in its GGUF quantized form.

Index legend: n activation rows (> 8), in = the row length of x and W, out = rows of W.

matvec.py reads every weight once per call and is bound by that read. With n rows a
matvec would read W n/8 times; here a thread block computes a 32 x 32 tile of y (32 rows
of W against 32 rows of x) and walks `in` one quantization block (32 values) at a time:

1. 128 of its 256 threads dequantize the tile's 32 weight rows x 32 values into shared
   memory, each one part of one row with matvec's dequantizers (so each weight is read
   from global memory once per 32 rows of x, not once per row);
2. all 256 load the matching 32 x 32 values of x into shared memory (consecutive threads,
   consecutive values: coalesced);
3. after a barrier, thread (tx, ty) adds 32 products to each of its 4 outputs:
   column tx of W against rows ty, ty + 8, ty + 16, ty + 24 of x. The weight tile has
   33 columns so that the 32 lanes of a warp, reading column k of 32 different rows, hit
   32 different shared-memory banks; the x values are the same for the whole warp (one
   broadcast).

A second barrier keeps the next block's writes from overtaking this block's reads.

Tolerance: as matvec.py (`dot_tolerance`). Each output is a float32 sum of `in` products
added one after another, the reference's is BLAS's order; both are within (in + 1) u
sum_i |x_i w_i| of the exact value, so within 2 (in + 1) u sum_i |x_i| |w_i| of each
other.

Known limit: each thread loads 5 shared values for 4 multiply-adds, so the kernel is
bound by shared-memory traffic, not by tensor cores; register tiles of several columns
per thread (and a 64 x 64 tile) are the next step on a GPU.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.kernels.launch import DeviceArgs, expect
from strata_nb.kernels.matvec import PART, PARTS, QK, QTYPES, matvec_ref, part_column, row_bytes, weight_views

TILE = 32  # rows of W and rows of x per thread block
THREADS_Y = 8  # the block is (32, 8) threads
ROWS_PER_THREAD = TILE // THREADS_Y  # 4 rows of x per thread


# --8<-- [start:matmul_ref]
def matmul_ref(x, raw, qtype, y):
    """x (n, in) float32, raw (out, bytes_per_row) uint8, y (n, out) float32 written:
    the same product as matvec_ref, for any n."""
    matvec_ref(x, raw, qtype, y)
# --8<-- [end:matmul_ref]


# --8<-- [start:matmul_kernel]
def make_matmul_kernel(part, nibbles):
    @cuda.jit
    def matmul_kernel(x,  # (n, in) float32
                      a,  # (out, *) view a of W's rows (matvec.QTYPES)
                      b,  # (out, *) view b of the same bytes
                      y):  # (n, out) float32, written
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        t = ty * TILE + tx
        o0, i0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE  # first row of W, of x
        n, n_in = x.shape
        n_out = y.shape[1]
        w_tile = cuda.shared.array((TILE, QK + 1), float32)  # (32 rows of W, 32 values + 1 pad)
        x_tile = cuda.shared.array((TILE, QK), float32)  # (32 rows of x, 32 values)
        w = cuda.local.array(PART, float32)
        acc = cuda.local.array(ROWS_PER_THREAD, float32)
        for m in range(ROWS_PER_THREAD):
            acc[m] = float32(0.0)

        for blk in range(n_in // QK):
            if t < TILE * PARTS:  # threads 0..127: part t % 4 of weight row t // 4
                row, p = t // PARTS, t % PARTS
                if o0 + row < n_out:
                    part(a[o0 + row], b[o0 + row], blk, p, w)
                else:  # past the last row of W: zeros, whose outputs are never stored
                    for j in range(PART):
                        w[j] = float32(0.0)
                for j in range(PART):
                    w_tile[row, part_column(nibbles, p, j)] = w[j]
            for m in range(TILE * QK // (TILE * THREADS_Y)):  # 4 values of x per thread
                e = m * TILE * THREADS_Y + t
                i, k = e // QK, e % QK
                x_tile[i, k] = x[i0 + i, blk * QK + k] if i0 + i < n else float32(0.0)
            cuda.syncthreads()  # both tiles complete before anyone multiplies

            for k in range(QK):
                wk = w_tile[tx, k]
                for m in range(ROWS_PER_THREAD):
                    acc[m] += x_tile[ty + THREADS_Y * m, k] * wk
            cuda.syncthreads()  # everyone is done with the tiles before they are refilled

        o = o0 + tx
        for m in range(ROWS_PER_THREAD):
            i = i0 + ty + THREADS_Y * m
            if o < n_out and i < n:
                y[i, o] = acc[m]

    return matmul_kernel


MATMUL_KERNELS = {qtype: make_matmul_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:matmul_kernel]


def matmul(x, raw, qtype, y):
    """Like matmul_ref, on the device, for any number of rows of x (the backend sends 1..8
    to matvec). NumPy arguments are moved (y is written back)."""
    expect("x", x, np.float32, (None, None))
    n, n_in = x.shape
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    if n == 0 or n_out == 0:
        return
    grid = (-(-n_out // TILE), -(-n // TILE))
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        MATMUL_KERNELS[qtype][grid, (TILE, THREADS_Y)](dev.read(x), a, b, dev.write(y))
