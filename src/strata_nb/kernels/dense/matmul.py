"""y = x @ W.T for many activation rows (a prompt chunk), W in its GGUF quantized form.

Index legend: n activation rows (> 8), in = the row length of x and W, out = rows of W.

matvec.py reads every weight once per call and is bound by that read. With n rows a
matvec would read W n/8 times; here a thread block computes a tile of y (rows of W
against rows of x) and walks `in` one quantization block (32 values) at a time, so each
weight is read from global memory once per tile of x rows, not once per row. Then the
work is arithmetic: 2 n out in flops, which an H200's float32 units do at most at
132 SMs x 128 lanes x 2 flops x 1.98 GHz = 67 TFLOP/s.

`matmul_kernel`: a 64 x 64 tile of y per 256-thread block.
1. Its threads dequantize the tile's 64 weight rows x 32 values into shared memory, one
   part of 8 values each, with gguf_rows.py's dequantizers;
2. they load the matching 64 x 32 values of x the same way, neighbouring threads on
   neighbouring values (coalesced);
3. after a barrier, thread (tx, ty) owns a 4 x 4 block of outputs: rows tx, tx + 16,
   tx + 32, tx + 48 of W against rows ty, ty + 16, ... of x. Per value k it loads 4
   weights and 4 x values from shared memory into registers and makes 16 multiply-adds
   from them: a register tile. Both tiles are stored k-major with rows padded to 65:
   the 16 lanes reading 16 neighbouring rows hit 16 different banks, and a warp's two
   ty values read the same x addresses (one broadcast).
4. A second barrier keeps the next step's writes from overtaking this step's reads.

Rows past the end of W or x are zeros; the stores skip them.

Tolerance: as matvec.py (`dot_tolerance`). Each output is a float32 sum of `in` products
added one after another (the zeros add nothing), the reference's is in BLAS's order;
both are within (in + 1) u sum_i |x_i w_i| of the exact value, so within
2 (in + 1) u sum_i |x_i| |w_i| of each other.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import MATMUL_SIDE, MATMUL_TILE
from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_bytes, weight_views
from strata_nb.kernels.dense.matvec import matvec_ref

# Under the simulator every thread is a Python thread and every padded row is computed,
# so the tiles are small there (geometry.py): a 15-token prompt is not computed as 64 rows.
# Tiles of 64, 16 x 16 threads of 4 x 4 outputs on a GPU (tiles of 16, 8 x 8 threads of
# 2 x 2, simulated). The dequantization needs THREADS == TILE * PARTS.
TILE = MATMUL_TILE  # rows of W and rows of x per thread block
PITCH = TILE + 1  # the shared tiles' row length: one pad column against bank conflicts
SIDE = MATMUL_SIDE  # the block is (16, 16) threads on a GPU
THREADS = SIDE * SIDE
PER_THREAD = TILE // SIDE  # each thread: 4 rows of W x 4 rows of x on a GPU


# --8<-- [start:matmul_ref]
def matmul_ref(x,      # (n, in) float32
               raw,    # (out, bytes_per_row) uint8: W's GGUF rows
               qtype,  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
               y):     # (n, out) float32, written
    """The same product as matvec_ref, for any n."""
    matvec_ref(x, raw, qtype, y)
# --8<-- [end:matmul_ref]


# --8<-- [start:matmul_kernel]
def make_matmul_kernel(part, nibbles):
    @cuda.jit(cache=True)
    def matmul_kernel(x,  # (n, in) float32
                      a,  # (out, *) view a of W's rows (gguf_rows.QTYPES)
                      b,  # (out, *) view b of the same bytes
                      y):  # (n, out) float32, written
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        t = ty * SIDE + tx
        o0, i0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE  # first row of W, of x
        n, n_in = x.shape
        n_out, n_blocks = y.shape[1], n_in // QK
        w_tile = cuda.shared.array((QK, PITCH), float32)  # w_tile[k, r]: value k of W row o0 + r
        x_tile = cuda.shared.array((QK, PITCH), float32)  # x_tile[k, i]: value k of x row i0 + i
        w = cuda.local.array(PART, float32)
        w_reg = cuda.local.array(PER_THREAD, float32)
        x_reg = cuda.local.array(PER_THREAD, float32)
        acc = cuda.local.array((PER_THREAD, PER_THREAD), float32)  # acc[r, m]: W row tx + 16 r, x row ty + 16 m
        for r in range(PER_THREAD):
            for m in range(PER_THREAD):
                acc[r, m] = float32(0.0)
        row, p = t // PARTS, t % PARTS  # the weight part this thread dequantizes: TILE rows x 4 parts
        lo, hi = part_runs(nibbles, p)

        for blk in range(n_blocks):
            if o0 + row < n_out:
                part(a, b, o0 + row, blk, p, w)
            else:
                for j in range(PART):
                    w[j] = float32(0.0)
            for j in range(4):
                w_tile[lo + j, row] = w[j]
                w_tile[hi + j, row] = w[4 + j]
            for e in range(t, TILE * QK, THREADS):  # 8 values of x per thread
                i, k = e // QK, e % QK
                x_tile[k, i] = x[i0 + i, blk * QK + k] if i0 + i < n else float32(0.0)
            cuda.syncthreads()  # both tiles complete before anyone multiplies

            for k in range(QK):
                for r in range(PER_THREAD):
                    w_reg[r] = w_tile[k, tx + SIDE * r]
                for m in range(PER_THREAD):
                    x_reg[m] = x_tile[k, ty + SIDE * m]
                for r in range(PER_THREAD):
                    for m in range(PER_THREAD):
                        acc[r, m] += x_reg[m] * w_reg[r]
            cuda.syncthreads()  # everyone is done with the tiles before they are refilled

        for m in range(PER_THREAD):
            i = i0 + ty + SIDE * m
            for r in range(PER_THREAD):
                o = o0 + tx + SIDE * r
                if o < n_out and i < n:
                    y[i, o] = acc[r, m]

    return matmul_kernel


assert THREADS == TILE * PARTS, "one weight part per thread"
MATMUL_KERNELS = {qtype: make_matmul_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:matmul_kernel]


def check(x, raw, qtype, y) -> tuple[int, int]:
    """(n, out) once x, raw and y have the dtypes and shapes a matmul launcher takes."""
    expect("x", x, np.float32, (None, None))
    n, n_in = x.shape
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    return n, n_out


def matmul(x, raw, qtype, y):
    """Like matmul_ref, on the device, for any number of rows of x. NumPy arguments are
    moved (y is written back); device arguments are used in place."""
    n, n_out = check(x, raw, qtype, y)
    if n == 0 or n_out == 0:
        return
    grid = (-(-n_out // TILE), -(-n // TILE))
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        MATMUL_KERNELS[qtype][grid, (SIDE, SIDE), stream()](dev.read(x), a, b, dev.write(y))
