"""y = x @ W.T for many activation rows (a prompt chunk), W in its GGUF quantized form.

Index legend: n activation rows (> 8), in = the row length of x and W, out = rows of W.

matvec.py reads every weight once per call and is bound by that read. With n rows a
matvec would read W n/8 times; here a thread block computes a tile of y (rows of W
against rows of x) and walks `in` one quantization block (32 values) at a time, so each
weight is read from global memory once per tile of x rows, not once per row. Then the
work is arithmetic: 2 n out in flops, which an H200's float32 units do at most at
132 SMs x 128 lanes x 2 flops x 1.98 GHz = 67 TFLOP/s. The tensor cores are faster
still: matmul_mma.py is this file's fast kernel with its products there, what a GPU
with tensor cores runs.

Two kernels, read in this order.

`matmul_kernel1`, the plain one: a 64 x 64 tile of y per 256-thread block.
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

`matmul_kernel`, the fast one the backend runs, makes the same sums in the same order
(so its outputs are the plain kernel's, bit for bit) and changes how the data reaches
them. What each change buys (the figures are in CHANGELOG.md, 2026-12-02, prefill):
- **Loads ahead (software pipelining).** The plain kernel's threads load a value of x,
  wait for it, store it, load the next: every step waits on global memory a few times
  over, and the multiply-adds wait with it. Here `fetch` reads the *next* step's weights
  (dequantized) and values of x into registers right after the barrier, and `stash`
  writes them to shared memory only after this step's multiply-adds: the loads are in
  flight while the SM computes. This is what made a larger register tile pay at all.
- **A larger register tile with 16-byte loads.** A thread owns 4 rows of W x 8 rows of x
  (32 outputs), in runs of 4 neighbouring rows: rows 4 tw..4 tw+3 of the tile's W, and
  4 tx..4 tx+3 and 4 (tx + 8)..+3 of its x. At each k a run is one 16-byte shared load,
  so a thread makes 32 multiply-adds from 3 loads, where the plain kernel makes 16 from
  8. The shared tiles are k-major, 16-byte aligned and padded by 4 values a row (not 1,
  which would break the alignment): x's stores, 4 rows x 8 values of k a warp, still
  hit 32 different banks.
- **A warp of 8 x 4 threads.** Lane l of warp (w, v) is thread (tw, tx) = (8 w + l % 8,
  4 v + l // 8), not 32 neighbours along W: at one k the warp's 32 loads of W fall on 8 runs of 16 bytes
  (one 128-byte wavefront, the rest broadcast) and each of its two loads of x on 4 runs,
  so shared memory serves the warp's 32 multiply-adds a thread in 3 wavefronts, where 32
  lanes along W take 6.
- **Written-out k.** The loop over a block's 32 values of k takes 4 a trip, with the
  4 calls written out (`multiply`), and the tiles are shaped (8, 4, pitch) so each is
  a constant offset: per value of k the thread runs its loads and multiply-adds and
  almost nothing else, where a loop trip per k spent ~15 integer instructions on its
  count and addresses next to 32 multiply-adds.
- **A 128 x 64 tile, 256 threads, 2 blocks per SM.** 126 registers a thread, so an SM
  keeps 2 thread blocks: one multiplies while the other waits at a barrier. 8 x 8
  outputs a thread (a 128 x 128 tile) needs ~180 registers, one block per SM, and was
  slower; so was a 64 x 64 tile of 4 x 4 (less reuse per load). The default model's
  576-row matrices still make 5 x 32 = 160 tiles of a 2,048-row chunk: each of the
  H200's 132 SMs gets at least one.

Rows past the end of W or x are zeros; the stores skip them.

Tolerance: as matvec.py (`dot_tolerance`). Each output is a float32 sum of `in` products
added one after another (the zeros add nothing), the reference's is in BLAS's order;
both are within (in + 1) u sum_i |x_i w_i| of the exact value, so within
2 (in + 1) u sum_i |x_i| |w_i| of each other.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.geometry import MATMUL_SIDE, MATMUL_TILE, MATMUL_W_THREADS, MATMUL_X_THREADS, VECTOR_ALIGN
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_bytes, weight_views
from strata_nb.kernels.dense.matvec import matvec_ref

# Under the simulator every thread is a Python thread and every padded row is computed,
# so both kernels' tiles are small there (geometry.py): a 15-token prompt is not computed
# as 64 or 128 rows.

# The plain kernel: tiles of 64, 16 x 16 threads of 4 x 4 outputs on a GPU (tiles of 16,
# 8 x 8 threads of 2 x 2, simulated). The dequantization needs THREADS == TILE * PARTS.
TILE = MATMUL_TILE  # rows of W and rows of x per thread block
PITCH = TILE + 1  # the shared tiles' row length: one pad column against bank conflicts
SIDE = MATMUL_SIDE  # the block is (16, 16) threads on a GPU
THREADS = SIDE * SIDE
PER_THREAD = TILE // SIDE  # each thread: 4 rows of W x 4 rows of x on a GPU

# The fast kernel: 32 x 8 threads of 4 x 8 outputs on a GPU (2 x 2 threads, simulated).
W_THREADS, X_THREADS = MATMUL_W_THREADS, MATMUL_X_THREADS  # threads along W's rows, along x's
W_REGS, X_REGS = 4, 8  # rows of W and of x per thread: runs of 4 (one 16-byte load each)
W_TILE_ROWS, X_TILE_ROWS = W_THREADS * W_REGS, X_THREADS * X_REGS  # 128 x 64 on a GPU
FAST_THREADS = W_THREADS * X_THREADS  # 256 on a GPU
W_PITCH, X_PITCH = W_TILE_ROWS + 4, X_TILE_ROWS + 4  # a shared row: the tile's rows, 4 pad values
RUNS = QK // 4  # a block's 32 values of k as 8 runs of 4 (the loop's trips)


def loader_sizes(threads: int, w_rows: int, x_rows: int) -> tuple[int, ...]:
    """How `threads` threads fetch a tile of w_rows of W and x_rows of x (make_tile_loader):
    a pass over the tile takes W_STEP rows of W, one part (8 values) from each of 4 threads,
    and X_STEP rows of x, X_LANES neighbouring values from each of X_LANES threads (8
    threads = 32 bytes). -> (X_LANES, W_STEP, X_STEP, W_PASSES, X_PASSES, W_NEXT, X_NEXT),
    the last two the registers fetch fills."""
    x_lanes = min(8, threads)
    w_step, x_step = threads // PARTS, threads // x_lanes
    assert w_rows % w_step == 0 and x_rows % x_step == 0, "every thread fetches as much"
    w_passes, x_passes = w_rows // w_step, x_rows // x_step
    return x_lanes, w_step, x_step, w_passes, x_passes, w_passes * PART, x_passes * (QK // x_lanes)


# the fast kernel's: 2 passes of W and 2 of x on a GPU, registers 16 and 8
X_LANES, W_STEP, X_STEP, W_PASSES, X_PASSES, W_NEXT, X_NEXT = loader_sizes(FAST_THREADS, W_TILE_ROWS, X_TILE_ROWS)
# a warp: LANES_W threads along W x LANES_X along x (8 x 4 on a GPU), WARPS_W warps along W
LANES_W = min(8, W_THREADS)
LANES_X = min(32 // LANES_W, X_THREADS)
WARP_LANES, WARPS_W = LANES_W * LANES_X, W_THREADS // LANES_W
WARP_SHIFT, WARPS_W_SHIFT, LANES_W_SHIFT = (v.bit_length() - 1 for v in (WARP_LANES, WARPS_W, LANES_W))
assert W_REGS % 4 == 0 and X_REGS % 4 == 0, "a thread's rows are runs of 4"
assert all(v & (v - 1) == 0 for v in (W_THREADS, X_THREADS, LANES_W, WARP_LANES, WARPS_W)), "powers of 2"


# --8<-- [start:matmul_ref]
def matmul_ref(x,      # (n, in) float32
               raw,    # (out, bytes_per_row) uint8: W's GGUF rows
               qtype,  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
               y):     # (n, out) float32, written
    """The same product as matvec_ref, for any n."""
    matvec_ref(x, raw, qtype, y)
# --8<-- [end:matmul_ref]


# --8<-- [start:matmul_kernel1]
def make_matmul_kernel1(part, nibbles):
    @cuda.jit(cache=True)
    def matmul_kernel1(x,  # (n, in) float32
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

    return matmul_kernel1


assert THREADS == TILE * PARTS, "one weight part per thread"
MATMUL_KERNELS1 = {qtype: make_matmul_kernel1(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:matmul_kernel1]


def check(x, raw, qtype, y) -> tuple[int, int]:
    """(n, out) once x, raw and y have the dtypes and shapes both launchers take."""
    expect("x", x, np.float32, (None, None))
    n, n_in = x.shape
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    return n, n_out


def launch(kernels, w_rows: int, x_rows: int, threads, x, raw, qtype, y):
    """Check the arrays, move NumPy ones, and launch kernels[qtype] on tiles of w_rows of W
    x x_rows of x, `threads` a block: every matmul launcher (this file's, matmul_mma's)."""
    n, n_out = check(x, raw, qtype, y)
    if n == 0 or n_out == 0:
        return
    grid = (-(-n_out // w_rows), -(-n // x_rows))
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        kernels[qtype][grid, threads, stream()](dev.read(x), a, b, dev.write(y))


def matmul1(x, raw, qtype, y):
    """Like matmul_ref, on the device, with the plain kernel (tests run it; the backend
    runs `matmul`)."""
    launch(MATMUL_KERNELS1, TILE, TILE, (SIDE, SIDE), x, raw, qtype, y)


# --8<-- [start:matmul_kernel]
@cuda.jit(device=True)
def thread_place(t):
    """(tw, tx) of thread t: its rows of the tile are runs 4 tw and 4 (tx + X_THREADS g).
    Masks and shifts, all by powers of 2: the compiler sees they are not negative, so the
    indices built from them need no wrap-around check and the loads stay 16-byte."""
    lane, warp = t & (WARP_LANES - 1), t >> WARP_SHIFT
    tw = (warp & (WARPS_W - 1)) * LANES_W + (lane & (LANES_W - 1))
    tx = (warp >> WARPS_W_SHIFT) * LANES_X + (lane >> LANES_W_SHIFT)
    return tw, tx


def make_tile_loader(part, nibbles, threads, w_rows, x_rows):
    """fetch, stash and their step, next_block, for a block of `threads` threads and a tile
    of w_rows of W and x_rows of x, for one weight type: the fast kernel's here, and
    matmul_mma.py's."""
    X_LANES, W_STEP, X_STEP, W_PASSES, X_PASSES, _, _ = loader_sizes(threads, w_rows, x_rows)

    @cuda.jit(device=True)
    def fetch(x, a, b, blk, t, o0, i0,
              w_next,  # (W_NEXT,) float32, written: the thread's weight parts of block blk, dequantized
              x_next):  # (X_NEXT,) float32, written: its values of x in block blk
        """Quantization block blk of the tile's rows of W and of x, from global memory into
        registers. A warp takes 8 rows x 4 parts of W (Q4_1: 8 runs of 16 code bytes) and
        4 rows x 8 values of x (4 runs of 32 bytes): neighbouring lanes, neighbouring bytes."""
        n, n_out = x.shape[0], a.shape[0]
        w = cuda.local.array(PART, float32)
        p = t % PARTS
        for u in range(W_PASSES):
            row = o0 + t // PARTS + W_STEP * u
            if row < n_out:
                part(a, b, row, blk, p, w)
            else:
                for j in range(PART):
                    w[j] = float32(0.0)
            for j in range(PART):
                w_next[PART * u + j] = w[j]
        for u in range(X_PASSES):
            i = i0 + t // X_LANES + X_STEP * u
            for d in range(QK // X_LANES):
                k = QK * blk + X_LANES * d + t % X_LANES
                x_next[QK // X_LANES * u + d] = x[i, k] if i < n else float32(0.0)

    @cuda.jit(device=True)
    def stash(t, w_next, x_next,
              w_tile,  # (RUNS, 4, W_PITCH) float32 shared, written: [k // 4, k % 4, r] = value k of W row o0 + r
              x_tile):  # (RUNS, 4, X_PITCH) float32 shared, written: [k // 4, k % 4, i] = value k of x row i0 + i
        """What fetch loaded, into the shared tiles, k-major. Each thread's addresses are
        one base plus constants, so they hold no registers while the step multiplies."""
        lo, hi = part_runs(nibbles, t % PARTS)
        for u in range(W_PASSES):
            row = t // PARTS + W_STEP * u
            for j in range(4):
                w_tile[(lo + j) // 4, (lo + j) % 4, row] = w_next[PART * u + j]
                w_tile[(hi + j) // 4, (hi + j) % 4, row] = w_next[PART * u + 4 + j]
        for u in range(X_PASSES):
            i = t // X_LANES + X_STEP * u
            for d in range(QK // X_LANES):
                k = X_LANES * d + t % X_LANES
                x_tile[k // 4, k % 4, i] = x_next[QK // X_LANES * u + d]

    @cuda.jit(device=True)
    def next_block(x, a, b, blk, n_blocks, t, o0, i0, w_next, x_next, w_tile, x_tile):
        """Block blk (fetched by the step before, or by a first fetch) into the shared tiles,
        a barrier, and block blk + 1's loads in flight while this one multiplies."""
        stash(t, w_next, x_next, w_tile, x_tile)
        cuda.syncthreads()  # both tiles complete before anyone multiplies
        if blk + 1 < n_blocks:
            fetch(x, a, b, blk + 1, t, o0, i0, w_next, x_next)

    return fetch, next_block


def make_matmul_kernel(part, nibbles):
    fetch, next_block = make_tile_loader(part, nibbles, FAST_THREADS, W_TILE_ROWS, X_TILE_ROWS)

    @cuda.jit(device=True)
    def multiply(w_k,  # (W_PITCH,) float32 shared: value k of the tile's rows of W
                 x_k,  # (X_PITCH,) float32 shared: value k of the tile's rows of x
                 tw, tx,
                 acc):  # (W_REGS, X_REGS) float32, added to: the thread's outputs
        """One value k: a 16-byte shared load per run of 4 rows, then W_REGS x X_REGS
        multiply-adds from registers."""
        w_reg = cuda.local.array(W_REGS, float32)
        x_reg = cuda.local.array(X_REGS, float32)
        for g in range(W_REGS // 4):
            for j in range(4):
                w_reg[4 * g + j] = w_k[4 * (tw + W_THREADS * g) + j]
        for g in range(X_REGS // 4):
            for j in range(4):
                x_reg[4 * g + j] = x_k[4 * (tx + X_THREADS * g) + j]
        for r in range(W_REGS):
            for m in range(X_REGS):
                acc[r, m] += x_reg[m] * w_reg[r]

    @cuda.jit(cache=True)
    def matmul_kernel(x,  # (n, in) float32
                      a,  # (out, *) view a of W's rows (gguf_rows.QTYPES)
                      b,  # (out, *) view b of the same bytes
                      y):  # (n, out) float32, written
        t = cuda.threadIdx.x
        tw, tx = thread_place(t)
        o0, i0 = cuda.blockIdx.x * W_TILE_ROWS, cuda.blockIdx.y * X_TILE_ROWS  # first row of W, of x
        n, n_in = x.shape
        n_out, n_blocks = y.shape[1], n_in // QK
        # aligned to 16 bytes, so a run of 4 rows at one k is one load
        w_tile = cuda.shared.array((RUNS, 4, W_PITCH), float32, VECTOR_ALIGN)
        x_tile = cuda.shared.array((RUNS, 4, X_PITCH), float32, VECTOR_ALIGN)
        w_next = cuda.local.array(W_NEXT, float32)
        x_next = cuda.local.array(X_NEXT, float32)
        # acc[4 g + j, 4 h + l]: W row o0 + 4 (tw + W_THREADS g) + j, x row i0 + 4 (tx + X_THREADS h) + l
        acc = cuda.local.array((W_REGS, X_REGS), float32)
        for r in range(W_REGS):
            for m in range(X_REGS):
                acc[r, m] = float32(0.0)

        fetch(x, a, b, 0, t, o0, i0, w_next, x_next)
        for blk in range(n_blocks):
            next_block(x, a, b, blk, n_blocks, t, o0, i0, w_next, x_next, w_tile, x_tile)
            for run in range(RUNS):  # 4 values of k a trip, written out
                multiply(w_tile[run, 0], x_tile[run, 0], tw, tx, acc)
                multiply(w_tile[run, 1], x_tile[run, 1], tw, tx, acc)
                multiply(w_tile[run, 2], x_tile[run, 2], tw, tx, acc)
                multiply(w_tile[run, 3], x_tile[run, 3], tw, tx, acc)
            cuda.syncthreads()  # everyone is done with the tiles before they are refilled

        for h in range(X_REGS // 4):
            for l in range(4):
                i = i0 + 4 * (tx + X_THREADS * h) + l
                for g in range(W_REGS // 4):
                    for j in range(4):
                        o = o0 + 4 * (tw + W_THREADS * g) + j
                        if o < n_out and i < n:
                            y[i, o] = acc[4 * g + j, 4 * h + l]

    return matmul_kernel


MATMUL_KERNELS = {qtype: make_matmul_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:matmul_kernel]


def matmul(x, raw, qtype, y):
    """Like matmul_ref, on the device, for any number of rows of x (the backend sends 1..8
    to matvec). NumPy arguments are moved (y is written back)."""
    launch(MATMUL_KERNELS, W_TILE_ROWS, X_TILE_ROWS, FAST_THREADS, x, raw, qtype, y)
