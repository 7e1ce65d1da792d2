"""y = x @ W.T for many activation rows (a prompt chunk), W in its GGUF quantized form.

Index legend: n activation rows (> 8), in = the row length of x and W, out = rows of W.

matvec.py reads every weight once per call and is bound by that read. With n rows a
matvec would read W n/8 times; here a thread block computes a 32 x 32 tile of y (32 rows
of W against 32 rows of x) and walks `in` 128 values (4 quantization blocks) at a time:

1. its 128 threads dequantize the tile's 32 weight rows x 128 values into shared memory,
   four parts of 8 values each, with matvec's dequantizers; neighbouring threads take
   neighbouring parts of a row, so the warp's loads are one contiguous run (coalesced),
   and each weight is read from global memory once per 32 rows of x, not once per row;
2. they load the matching 32 x 128 values of x into shared memory the same way;
3. after a barrier, thread (tx, ty) adds 128 products to each of its 8 outputs:
   row tx of W against rows ty, ty + 4, ..., ty + 28 of x. The weight tile has
   129 columns so that the 32 lanes of a warp, reading column k of 32 different rows,
   hit 32 different shared-memory banks; the x values are the same for the whole warp
   (one broadcast).

A second barrier keeps the next step's writes from overtaking this step's reads. 128
values a step rather than 32 means a quarter of the barriers (which also makes the
kernel affordable under the simulator, where a barrier wakes every thread of the block
in turn). Parts past the end of the row or of W are zeros.

Tolerance: as matvec.py (`dot_tolerance`). Each output is a float32 sum of `in` products
added one after another (the zeros add nothing), the reference's is in BLAS's order;
both are within (in + 1) u sum_i |x_i w_i| of the exact value, so within
2 (in + 1) u sum_i |x_i| |w_i| of each other.

Known limit: each thread loads 9 shared values (one weight, 8 broadcast x values) for 8
multiply-adds, so the kernel is bound by shared-memory traffic, far from the tensor
cores; register tiles of several weight rows per thread (and a 64 x 64 tile) are the
next step on a GPU.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.kernels.launch import DeviceArgs, expect, stream
from strata_nb.kernels.matvec import PART, PARTS, QK, QTYPES, matvec_ref, part_runs, row_bytes, weight_views

TILE = 32  # rows of W and rows of x per thread block
TILE_K = 4 * QK  # values of the row per step: 4 quantization blocks
W_PITCH = TILE_K + 1  # the weight tile's row length in shared memory: one pad column
THREADS_Y = 4  # the block is (32, 4) threads
THREADS = TILE * THREADS_Y
ROWS_PER_THREAD = TILE // THREADS_Y  # 8 rows of x per thread


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
        n_out, n_blocks = y.shape[1], n_in // QK
        w_tile = cuda.shared.array((TILE, W_PITCH), float32)  # (32 rows of W, 128 values + 1 pad)
        x_tile = cuda.shared.array((TILE, TILE_K), float32)  # (32 rows of x, 128 values)
        w = cuda.local.array(PART, float32)
        acc = cuda.local.array(ROWS_PER_THREAD, float32)
        for m in range(ROWS_PER_THREAD):
            acc[m] = float32(0.0)

        for k0 in range(0, n_in, TILE_K):
            for e in range(t, TILE * TILE_K // PART, THREADS):  # 512 parts: 4 per thread
                row, q = e // (TILE_K // PART), e % (TILE_K // PART)  # q: part of the row in this step
                blk, p = k0 // QK + q // PARTS, q % PARTS
                if o0 + row < n_out and blk < n_blocks:
                    part(a[o0 + row], b[o0 + row], blk, p, w)
                else:
                    for j in range(PART):
                        w[j] = float32(0.0)
                lo, hi = part_runs(nibbles, p)
                base = q // PARTS * QK  # the block's first column in the tile
                for j in range(4):
                    w_tile[row, base + lo + j] = w[j]
                    w_tile[row, base + hi + j] = w[4 + j]
            for e in range(t, TILE * TILE_K, THREADS):  # 32 values of x per thread
                i, k = e // TILE_K, e % TILE_K
                inside = i0 + i < n and k0 + k < n_in
                x_tile[i, k] = x[i0 + i, k0 + k] if inside else float32(0.0)
            cuda.syncthreads()  # both tiles complete before anyone multiplies

            for k in range(TILE_K):
                wk = w_tile[tx, k]
                for m in range(ROWS_PER_THREAD):
                    if i0 + ty + THREADS_Y * m < n:  # the same for the whole warp: no divergence
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
        MATMUL_KERNELS[qtype][grid, (TILE, THREADS_Y), stream()](dev.read(x), a, b, dev.write(y))
