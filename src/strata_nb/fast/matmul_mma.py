"""Plain twin: kernels/dense/matmul.py matmul_kernel. The product on tensor cores: the
tiled matmul (matmul_tiled.py, read it first) with its multiply-adds done as warp-wide
matrix products (fast/tensor_core.py), what a GPU with tensor cores runs for a prompt
chunk. Within dot_tolerance of the plain kernel, not its bits.

What stays: a thread block per tile of rows of W x rows of x, walking `in` one
quantization block (32 values) at a time, and the same fetch and stash
(matmul_tiled.make_tile_loader): the next block's weights, dequantized, and values of x are in
registers while this block multiplies, then written to the shared tiles k-major,
[k // 4, k % 4, row].

What changes: the tile is 64 x 64 on 128 threads (a warp, 32 x 32, under the simulator),
and the block's 4 warps each own 32 rows of x x 32 rows of W of it (2 along each), as
2 x 4 products of 16 x 8 (tensor_core's fragments, g = lane // 4, t = lane % 4). Per 8
values of k a warp loads its A fragments (x: rows g and g + 8 of each 16, values t and
t + 4) and B fragments (W: row g of each 8, values t and t + 4) from the shared tiles and
makes 8 products, three TF32 ones each (`mma_f32`): 24 tensor instructions where the
tiled kernel's warp makes 8 x 32 fused multiply-adds a lane. The tiles' rows are padded by
4 values, as the tiled kernel's: a fragment's 32 loads hit 32 banks (bank 4t + g). The
tile is smaller than the tiled kernel's so that a thread's registers let an SM keep 3
blocks without spilling (launch bounds hold ptxas to that).

Precision: each output is a float32 sum over k, in blocks of 8 products summed by the
tensor core, within the same bound as the tiled kernel's (matvec.dot_tolerance); the
bits differ from it, so a process uses one or the other (gpu/tensor_core.enabled
switches this kernel and the prompt attention's together).

Split sums (split-K). A short chunk makes few tiles: 60 rows of x against the default
model's 576-row matrices are 9 thread blocks, each walking all of `in`, on a GPU of 132
SMs. Then the launch is latency, not work. So `in` is cut into *segments* of
SEGMENT_BLOCKS quantization blocks, and a thread block sums its segments each into a
fresh accumulator, adding it to the output's running total when the segment ends:

    total = 0;  for each segment j:  total += (the segment's products, summed)

A short chunk gives each segment its own thread block (the grid's third axis), which
writes its segment's sum to a scratch array; `sum_segments_kernel` then adds them up, in
segment order from 0, as the unsplit kernel does. The additions are the same, so split
or not, every output has the same bits: the launcher may choose by the size of the grid
(`split_for`) and a row's result still does not depend on how many rows came with it
(engine/prompt_chunk.py: rows alone).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from strata_nb.fast.gguf_fetch import QTYPES
from strata_nb.fast.matmul_tiled import W_REGS, X_REGS, loader_sizes, make_tile_loader
from strata_nb.gpu.geometry import MATMUL_MMA_SPLIT_BELOW, MATMUL_MMA_W_THREADS, MATMUL_MMA_X_THREADS, SIMULATED
from strata_nb.gpu.launch import DeviceArgs, device_empty, grid_for, stream
from strata_nb.gpu.reduce import WARP
from strata_nb.fast.tensor_core import TILE_K, TILE_M, TILE_N, mma_f32
from strata_nb.kernels.dense.gguf_rows import QK, weight_views
from strata_nb.kernels.dense.matmul import check

W_THREADS, X_THREADS = MATMUL_MMA_W_THREADS, MATMUL_MMA_X_THREADS  # 16 x 8 on a GPU, 8 x 4 (one warp) simulated
THREADS = W_THREADS * X_THREADS
W_TILE_ROWS, X_TILE_ROWS = W_THREADS * W_REGS, X_THREADS * X_REGS  # 64 x 64 on a GPU, 32 x 32 simulated
WARP_ROWS = 32  # rows of W, and of x, a warp owns
WARPS_W = W_TILE_ROWS // WARP_ROWS
M_TILES, N_TILES = WARP_ROWS // TILE_M, WARP_ROWS // TILE_N  # a warp's products: 2 along x, 4 along W
W_PITCH, X_PITCH = W_TILE_ROWS + 4, X_TILE_ROWS + 4
RUNS = QK // 4
_, _, _, _, _, W_NEXT, X_NEXT = loader_sizes(THREADS, W_TILE_ROWS, X_TILE_ROWS)
assert (W_TILE_ROWS // WARP_ROWS) * (X_TILE_ROWS // WARP_ROWS) * WARP == THREADS, "a warp per 32 x 32"
U8 = uint64(8)
OUTPUTS = M_TILES * N_TILES * 4  # a thread's outputs: 4 of each of its products
SEGMENT_BLOCKS = 2  # quantization blocks (64 values of k) a segment sums before adding to the total
# 3 blocks an SM: ptxas keeps to 168 registers a thread (the simulator's jit takes no
# launch bounds)
LAUNCH_BOUNDS = {} if SIMULATED else {"launch_bounds": (THREADS, 3)}


# --8<-- [start:matmul_mma_kernel]
def segments(n_in):
    """The segments of a row of `in` values: the last may be short."""
    return (n_in // QK + SEGMENT_BLOCKS - 1) // SEGMENT_BLOCKS


segments_on_device = cuda.jit(device=True)(segments)  # the same function, for the kernel


def make_matmul_mma_kernel(part, nibbles):
    fetch, next_block = make_tile_loader(part, nibbles, THREADS, W_TILE_ROWS, X_TILE_ROWS)

    @cuda.jit(cache=True, **LAUNCH_BOUNDS)
    def matmul_mma_kernel(x,  # (n, in) float32
                          a,  # (out, *) view a of W's rows (gguf_rows.QTYPES)
                          b,  # (out, *) view b of the same bytes
                          y):  # (splits, n, out) float32, written: [z] = the sum over thread block z's segments
        t = cuda.threadIdx.x
        warp, lane = t // WARP, t % WARP
        g, tq = uint64(lane // 4), uint64(lane % 4)
        w0 = uint64((warp % WARPS_W) * WARP_ROWS)  # the warp's first row of the tile's W
        x0 = uint64((warp // WARPS_W) * WARP_ROWS)  # and of its x
        o0, i0, z = cuda.blockIdx.x * W_TILE_ROWS, cuda.blockIdx.y * X_TILE_ROWS, cuda.blockIdx.z
        n, n_in = x.shape
        n_out, n_blocks = y.shape[2], n_in // QK
        per = 1 if y.shape[0] > 1 else segments_on_device(n_in)  # segments a thread block sums: 1, or all of them
        first = z * per * SEGMENT_BLOCKS  # its quantization blocks: first .. end - 1
        end = min(first + per * SEGMENT_BLOCKS, n_blocks)
        w_tile = cuda.shared.array((RUNS, 4, W_PITCH), float32)  # [k // 4, k % 4, r]: value k of W row o0 + r
        x_tile = cuda.shared.array((RUNS, 4, X_PITCH), float32)  # [k // 4, k % 4, i]: value k of x row i0 + i
        w_next = cuda.local.array(W_NEXT, float32)
        x_next = cuda.local.array(X_NEXT, float32)
        # acc[mt, nt, :]: the C fragment of x rows x0 + 16 mt .. +15 against W rows w0 + 8 nt .. +7,
        # over this segment; total[4 (N_TILES mt + nt) + i, t]: the same outputs over the segments
        # before it (in shared memory: the registers are all taken; thread t's own column, so no
        # barrier, and a warp's 32 columns are 32 banks)
        acc = cuda.local.array((M_TILES, N_TILES, 4), float32)
        total = cuda.shared.array((OUTPUTS, THREADS), float32)
        for mt in range(M_TILES):
            for nt in range(N_TILES):
                for i in range(4):
                    acc[mt, nt, i] = float32(0.0)
                    total[4 * (N_TILES * mt + nt) + i, t] = float32(0.0)

        fetch(x, a, b, first, t, o0, i0, w_next, x_next)
        for blk in range(first, end):
            next_block(x, a, b, blk, end, t, o0, i0, w_next, x_next, w_tile, x_tile)
            for ks in range(QK // TILE_K):  # 8 values of k: runs 2 ks (values t) and 2 ks + 1 (t + 4)
                lo, hi = uint64(2 * ks), uint64(2 * ks + 1)
                for mt in range(M_TILES):  # A: x rows g, g + 8 at values t, then t + 4
                    r = x0 + uint64(TILE_M * mt) + g
                    a0, a1 = x_tile[lo, tq, r], x_tile[lo, tq, r + U8]
                    a2, a3 = x_tile[hi, tq, r], x_tile[hi, tq, r + U8]
                    for nt in range(N_TILES):  # B: W row g of the 8, values t and t + 4
                        c = w0 + uint64(TILE_N * nt) + g
                        acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3] = mma_f32(
                            a0, a1, a2, a3, w_tile[lo, tq, c], w_tile[hi, tq, c],
                            acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
            if (blk + 1) % SEGMENT_BLOCKS == 0 or blk + 1 == end:  # a segment ends: into the total
                for mt in range(M_TILES):
                    for nt in range(N_TILES):
                        for i in range(4):
                            total[4 * (N_TILES * mt + nt) + i, t] += acc[mt, nt, i]
                            acc[mt, nt, i] = float32(0.0)
            cuda.syncthreads()  # everyone is done with the tiles before they are refilled

        # d0..d3: x rows g (d0, d1) and g + 8 (d2, d3), W rows 2t and 2t + 1 of each product
        for mt in range(M_TILES):
            for nt in range(N_TILES):
                for i in range(4):
                    row = i0 + int(x0) + TILE_M * mt + int(g) + 8 * (i // 2)
                    col = o0 + int(w0) + TILE_N * nt + 2 * int(tq) + i % 2
                    if row < n and col < n_out:
                        y[z, row, col] = total[4 * (N_TILES * mt + nt) + i, t]

    return matmul_mma_kernel


MATMUL_MMA_KERNELS = {qtype: make_matmul_mma_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}


# --8<-- [start:split_sums]
@cuda.jit(cache=True)
def sum_segments_kernel(parts,  # (segments, n, out) float32: each segment's sums
                        y):  # (n, out) float32, written
    """y = the segments' sums added in order from 0, as the unsplit kernel adds them: a
    thread an output, a row of y a row of thread blocks."""
    o, i = cuda.grid(1), cuda.blockIdx.y
    if o < y.shape[1]:
        s = float32(0.0)
        for j in range(parts.shape[0]):
            s += parts[j, i, o]
        y[i, o] = s
# --8<-- [end:matmul_mma_kernel]


def split_for(n: int, n_in: int, n_out: int) -> int:
    """Thread blocks along `in`: one per segment when the tiles alone would leave most of a
    GPU's SMs idle (fewer than MATMUL_MMA_SPLIT_BELOW), else 1."""
    tiles = -(-n_out // W_TILE_ROWS) * -(-n // X_TILE_ROWS)
    return segments(n_in) if tiles < MATMUL_MMA_SPLIT_BELOW else 1
# --8<-- [end:split_sums]


def matmul_mma(x, raw, qtype, y, splits: int | None = None):
    """Like kernels/dense/matmul.py matmul, on tensor cores (needs compute capability 8.0:
    the caller checks, gpu/tensor_core.available). splits: thread blocks along `in`, 1 or
    one per segment (the same bits either way); None chooses (split_for)."""
    n, n_out = check(x, raw, qtype, y)
    if n == 0 or n_out == 0:
        return
    n_in = x.shape[1]
    n_segments = segments(n_in)
    splits = split_for(n, n_in, n_out) if splits is None else splits
    assert splits in (1, n_segments), f"split into 1 or {n_segments} (one per segment), not {splits}"
    grid = (-(-n_out // W_TILE_ROWS), -(-n // X_TILE_ROWS), splits)
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        out = dev.write(y)
        parts = out.reshape(1, n, n_out) if splits == 1 else device_empty((splits, n, n_out), np.float32)
        MATMUL_MMA_KERNELS[qtype][grid, THREADS, stream()](dev.read(x), a, b, parts)
        if splits > 1:
            blocks, threads, on = grid_for(n_out)
            sum_segments_kernel[(blocks, n), threads, on](parts, out)
