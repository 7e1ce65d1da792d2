"""Plain twin: kernels/dense/matmul.py matmul_kernel. The same sums in the same order (so
its outputs are the plain kernel's, bit for bit), the data brought to them faster: loads
ahead, a 4 x 8 register tile read 16 bytes at a time, a 128 x 64 tile; the matmul the
fast engine runs on a GPU without tensor cores (matmul_mma.py builds on its loads).

What each change buys:
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

Rows past the end of W or x are zeros; the stores skip them. Tolerance: as the plain
kernel's, which it equals bit for bit.
"""
from __future__ import annotations

from numba import cuda, float32

from strata_nb.fast.gguf_fetch import QTYPES
from strata_nb.fast.twins import twin_of
from strata_nb.gpu.geometry import MATMUL_W_THREADS, MATMUL_X_THREADS, VECTOR_ALIGN
from strata_nb.gpu.launch import DeviceArgs, stream
from strata_nb.kernels.dense import matmul as plain
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, part_runs, weight_views
from strata_nb.kernels.dense.matmul import check

# 32 x 8 threads of 4 x 8 outputs on a GPU (2 x 2 threads, simulated: geometry.py).
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


# this file's kernel: 2 passes of W and 2 of x on a GPU, registers 16 and 8
X_LANES, W_STEP, X_STEP, W_PASSES, X_PASSES, W_NEXT, X_NEXT = loader_sizes(FAST_THREADS, W_TILE_ROWS, X_TILE_ROWS)
# a warp: LANES_W threads along W x LANES_X along x (8 x 4 on a GPU), WARPS_W warps along W
LANES_W = min(8, W_THREADS)
LANES_X = min(32 // LANES_W, X_THREADS)
WARP_LANES, WARPS_W = LANES_W * LANES_X, W_THREADS // LANES_W
WARP_SHIFT, WARPS_W_SHIFT, LANES_W_SHIFT = (v.bit_length() - 1 for v in (WARP_LANES, WARPS_W, LANES_W))
assert W_REGS % 4 == 0 and X_REGS % 4 == 0, "a thread's rows are runs of 4"
assert all(v & (v - 1) == 0 for v in (W_THREADS, X_THREADS, LANES_W, WARP_LANES, WARPS_W)), "powers of 2"


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
    of w_rows of W and x_rows of x, for one weight type: this file's kernel, and
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


@twin_of(plain.matmul)
def matmul(x, raw, qtype, y):
    """Plain twin: kernels/dense/matmul.py matmul. The same checks, this file's kernel on
    its 128 x 64 tiles of 256 threads: the plain kernel's outputs, bit for bit."""
    n, n_out = check(x, raw, qtype, y)
    if n == 0 or n_out == 0:
        return
    grid = (-(-n_out // W_TILE_ROWS), -(-n // X_TILE_ROWS))
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        MATMUL_KERNELS[qtype][grid, FAST_THREADS, stream()](dev.read(x), a, b, dev.write(y))
