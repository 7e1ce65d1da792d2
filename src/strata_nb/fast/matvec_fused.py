"""Plain twin: kernels/dense/matvec.py matvec_kernel (y = x @ W.T, a warp per row of W).
Fuses the ops around each product into it (the norm, SwiGLU, RoPE, the fp16 append, the
residual add), takes 4 rows of W a thread block and reads the next matrix into L2 ahead:
the matvec the fast engine runs. A decode step's time is the time to read its weights, so
each fusion either saves a launch (its fixed cost and its own trip through memory) or
keeps the weight loads from waiting.

`make_matvec_kernel` builds one kernel per weight type (its dequantizer, gguf_fetch.py),
prologue, epilogue and rows of x a block (1 or 2): MATVEC_KERNELS, 5 x 3 x 4 x 2 of them,
each compiled the first time it is launched. The launcher `matvec_fused` picks one,
`matvec_fused_ref` is their spec and `fused_tolerance` their tolerance. `matvec` is the
plain launcher's twin (twins.py): the fused kernel with no prologue or epilogue.

What each fusion buys:

- rows of W per thread block: a thread block works on ROWS = 4 rows of W at once and
  its warps split each row's parts between them, so every thread has one or two parts
  per row and its loads of all 4 rows are in flight together, each value of x it loads
  serving 4 weights;
- rows of x per thread block: a thread keeps a sum for each (row of W, row of x) in
  registers, so a thread block takes at most ROW_GROUP = 2 rows of x, and a verify
  window's further rows go to more thread blocks (the grid's y), which read the same
  weights again, from L2. A decode step's kernel (1 row) holds 4 sums a thread, a
  window's 8; the fewer registers a thread needs, the more warps fit on an SM to hide
  the memory's latency.
- a *prologue* decides what it multiplies: x, rmsnorm(x) or swiglu(gate|up) (the forward
  pass's `normed_matmul`, `gated_matmul_add_`), so no norm or gate launch precedes it;
- an *epilogue* stores y, adds it to the residual (`matmul_add_`), or stores q|k|v with
  RoPE applied to the q and k heads (`normed_matmul_rope`), and in a decode step with
  an fp16/fp32 cache also writes k and v into the new cell: no add, RoPE or append
  launch follows it;
- before its own loads it reads the first bytes of the next matvec's weights into L2, so
  the next launch finds them there rather than in HBM.

The norm is applied last. rmsnorm(x) W = (1 / rms(x)) ((x * norm) W), so a normed kernel
multiplies x * norm, sums the squares of x from the values its first trip loads anyway
(its threads read every column of x once), reduces them with the products, and
multiplies each output's sum by 1 / rms: no block-wide sum of x (two barriers) holds the
weight loads back.

Reading ahead. A step's weights do not fit the L2 cache, so each matvec would find its
weights in HBM and its short chains of loads would wait the longer trip. So every
matvec is handed the matrix the step multiplies next (`ahead`: q|k|v -> o -> gate|up ->
down -> the next layer's q|k|v or the head -> the next step's first q|k|v), and before
its own loads each thread asks for the first byte of up to AHEAD 32-byte sectors of it
(the unit L2 caches from HBM). It uses those bytes only after its own work, so they
never hold it up, and by the next launch they are in L2. The bytes go into a XOR that is
written only when asked (`ahead_out`, the test's way in): a load whose value is never
used would be dropped by the compiler.

Appending in the epilogue. A decode step's fp16/fp32 cells are only cast when they are
stored, so the q|k|v matvec writes them itself (`append`, the "rope_append" epilogue):
the thread that stores a roped k or v pair stores it into the new cell too, through
kv_append_fp16's `store_cell`, the append kernel's own device body (VRAM slot if the
block is resident, host copy if there is one): one launch fewer a layer. The cell's
position is loaded before the weights and its page-table entry after their loads are
out, so neither holds them back.

Tolerance. Unfused, the kernel sums the plain kernel's products in another order (a
thread's parts of 4 rows, then the warp's tree, then the warps' sums), so the two, and
each and the reference, are within matvec.py's `dot_tolerance`. A fused prologue computes
the activations itself, so they may differ from rmsnorm_ref's or swiglu_ref's by those
kernels' own tolerances ((in + 8) u and 16 u, relatively); through the product that adds
rtol * sum_i |x_i| |w_i| (`fused_tolerance`). The normed kernel's 1 / rms has rmsnorm's
error, and scaling the sum rounds once more (u |y|, with |y| <= sum_i |x_i| |w_i|),
against the one rounding of x * inv it saves per value: within the same bound. A fused
add rounds once more on each side: 2 u |y| more.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from strata_nb.fast.gguf_fetch import QTYPES
from strata_nb.fast.twins import twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.geometry import MATVEC_MAX_BLOCKS, MATVEC_MAX_WARPS
from strata_nb.gpu.launch import DeviceArgs, absent, expect, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense import matvec as plain
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, part_runs, row_bytes, weight_views
from strata_nb.kernels.dense.matvec import MAX_ROWS, U, dot_tolerance, product_ref
from strata_nb.kernels.dense.rmsnorm import inv_rms, rmsnorm_ref
from strata_nb.kernels.dense.rope import rope_qkv_ref
from strata_nb.kernels.dense.swiglu import swiglu_ref
from strata_nb.kernels.kv.kv_append_fp16 import cell_home, expect_dest, kv_append_fp16_ref, store_cell
from strata_nb.kernels.kv.quant_q4_0 import mul_rn
from strata_nb.model.dequant import dequantize

ROW_GROUP = 2  # rows of x a thread block multiplies at most; more go to more thread blocks (grid y)
ROWS = 4  # rows of W a thread block works through together
SUM_WARPS = 8  # rows of the shared array the warps' sums meet in
SECTOR = 32  # bytes: what L2 caches from HBM at a time
AHEAD = 4  # sectors of the next matvec's rows each thread reads ahead
# Warps per thread block: enough for one part of each row per thread, at most 8; thread
# blocks at most 16 per SM of an H200 (a larger W is grid-strided, so the output head's
# norm is worked out once per thread block, not once per 4 rows). The simulator runs
# every CUDA thread as a Python thread and wakes them one by one at every barrier: one
# warp striding over all rows costs the least there.
MAX_WARPS, MAX_BLOCKS = MATVEC_MAX_WARPS, MATVEC_MAX_BLOCKS


# --8<-- [start:matvec_fused_ref]
def matvec_fused_ref(x,      # (n, in) float32; (n, 2 in) with swiglu: gate values, then up values
                     raw,    # (out, bytes_per_row) uint8: GGUF rows of W, (out, in) once dequantized
                     qtype,  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
                     y,      # (n, out) float32, written (added to, with add)
                     norm=None, eps=0.0,  # (in,) float32: multiply rmsnorm(x, norm, eps) instead of x
                     swiglu=False,        # multiply swiglu(x) instead of x
                     add=False,           # y += x @ W.T instead of y = x @ W.T
                     rope=None,           # (cos, sin, n_heads, n_kv): rotate y's q and k heads
                     append=None):        # with rope: (positions, page_table, k, v, host_k, host_v),
                                          # kv_append_fp16's arguments after k_new, v_new
    """The decode step's matrix products with what comes before and after them fused in:
    the norm before q|k|v, gate|up and the output head; RoPE after q|k|v, and the append of
    its k and v to an fp16/fp32 cache; the residual add after o and down. Each is its
    reference composed, in the same order."""
    x = prologue_ref(x, norm, eps, swiglu)
    if add:
        y += product_ref(x, dequantize(raw, qtype))
    elif rope is not None:
        cos, sin, n_heads, n_kv = rope
        n, hd = x.shape[0], 2 * cos.shape[1]
        q, k, v = (np.empty((n, heads, hd), np.float32) for heads in (n_heads, n_kv, n_kv))
        rope_qkv_ref(product_ref(x, dequantize(raw, qtype)), cos, sin, q, k, v)
        y[...] = np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1)
        if append is not None:
            kv_append_fp16_ref(k, v, *append)
    else:
        y[...] = product_ref(x, dequantize(raw, qtype))


def prologue_ref(x, norm, eps, swiglu):
    """The activations matvec_fused multiplies: x, rmsnorm(x) or swiglu(x)."""
    if norm is not None:
        normed = np.empty_like(x)
        rmsnorm_ref(x, norm, eps, normed)
        return normed
    if swiglu:
        gated = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
        swiglu_ref(x, gated)
        return gated
    return x


def fused_tolerance(x, w, norm=None, eps=0.0, swiglu=False):
    """dot_tolerance of the activations the kernel multiplies, plus what its own rmsnorm or
    swiglu may differ by from the reference's, carried through |W| (module docstring)."""
    xs = prologue_ref(x, norm, eps, swiglu)
    prologue_rtol = (x.shape[1] + 8) * U if norm is not None else (16 * U if swiglu else 0.0)
    return dot_tolerance(xs, w) + prologue_rtol * (np.abs(xs.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
# --8<-- [end:matvec_fused_ref]


# What this kernel adds to the plain kernel, each marked as a region the GPU pages include:
#   rows of W and warps per thread block  matvec_rows
#   the norm prologue     norm_prologue, norm_squares_init, norm_squares, norm_inv
#   the swiglu prologue   swiglu_prologue
#   the add epilogue      add_epilogue
#   the rope epilogue     rope_epilogue, rope_store
#   the append epilogue   append_pair, append_position, append_home
#   the read ahead        read_ahead, read_ahead_use, read_ahead_ref


# --8<-- [start:matvec_prologues]
# What the kernel multiplies by W, value x[r, col] of the row it reads, in two steps: the
# loads (fetch_*: two float32, the second unused by the plain prologue) and the arithmetic
# on them (x_*), so a trip's loads can all go out before any arithmetic waits for one (a
# division or an exp has a branch, and a load after a branch waits for what comes before
# it). A normed kernel multiplies x * norm and applies 1 / rms to each output's sum
# (rmsnorm(x) W = (1 / rms) (x * norm) W).
@cuda.jit(device=True)
def fetch_plain(x, norm, r, col, n_in):
    return x[r, col], float32(0.0)


@cuda.jit(device=True)
def x_plain(a, b):
    return a


# --8<-- [start:norm_prologue]
@cuda.jit(device=True)
def fetch_normed(x, norm, r, col, n_in):
    return x[r, col], norm[col]


@cuda.jit(device=True)
def x_normed(a, b):
    return a * b  # x * norm, times 1 / rms, which the kernel applies to the sum
# --8<-- [end:norm_prologue]


# --8<-- [start:swiglu_prologue]
@cuda.jit(device=True)
def fetch_gated(x, norm, r, col, n_in):
    return x[r, col], x[r, n_in + col]  # the gate and up halves of gate|up


@cuda.jit(device=True)
def x_gated(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u  # swiglu_kernel's expression
# --8<-- [end:swiglu_prologue]


@cuda.jit(device=True)
def y_store(y, r, o, total):
    y[r, o] = total


# --8<-- [start:add_epilogue]
@cuda.jit(device=True)
def y_add(y, r, o, total):
    y[r, o] += total  # the residual add: one rounding for the dot, one for the sum
# --8<-- [end:add_epilogue]


# --8<-- [start:rope_epilogue]
@cuda.jit(device=True)
def y_rope_pair(y, r, o, t0, t1, cos, sin, rope_rows, hd):
    """Outputs o and o + 1 (o even) of q|k|v: rotated as a RoPE pair when they are q or k
    (o < rope_rows), stored as they are when v; returns the pair stored. rope_qkv_kernel's
    products, in its order; hd is a power of two, so the pair index is a mask and a shift,
    not a division."""
    if o < rope_rows:
        pair = (o & (hd - 1)) >> 1
        c, s = cos[r, pair], sin[r, pair]
        t0, t1 = mul_rn(t0, c) - mul_rn(t1, s), mul_rn(t0, s) + mul_rn(t1, c)
    y[r, o], y[r, o + 1] = t0, t1
    return t0, t1
# --8<-- [end:rope_epilogue]
# --8<-- [end:matvec_prologues]


# --8<-- [start:append_pair]
def make_append_pair(store):
    """append_pair over a writer's device body: kv_append_fp16's store_cell (the tests hand
    in a broken one, to show that their checks catch it)."""

    @cuda.jit(device=True)
    def append_pair(o, u0, u1, rope_rows, hd, n_out, home, k, v, host_k, host_v):
        """Outputs o and o + 1 of q|k|v as stored: when they are k or v, they are also the
        step's new cell (home: its cell_home), written through the one writer's store_cell
        (VRAM slot if resident, host copy if present), as kv_append_fp16 would write them."""
        kv_rows = n_out - rope_rows  # v's outputs; k has as many, just before rope_rows
        if o < rope_rows - kv_rows:
            return  # q
        side = 0 if o < rope_rows else 1
        e = o - (rope_rows - kv_rows) - side * kv_rows  # the output's index within k or v
        h, j = 0, e & (hd - 1)  # o is even, so j + 1 is in the same head
        while e >= hd:  # h = e // hd without a 64-bit division (sm90.wide_divides): a few heads
            e -= hd
            h += 1
        block, cell, slot = home
        store(side, h, j, u0, block, cell, slot, k, v, host_k, host_v)
        store(side, h, j + 1, u1, block, cell, slot, k, v, host_k, host_v)

    return append_pair


@cuda.jit(device=True)
def no_append(o, u0, u1, rope_rows, hd, n_out, home, k, v, host_k, host_v):
    pass
# --8<-- [end:append_pair]


# --8<-- [start:matvec_kernel]
def make_matvec_kernel(part, nibbles, fetch_x, make_x, store_y, normed, x_rows, rows, rope=False, append_pair=None):
    """Plain twin: kernels/dense/matvec.py matvec_kernel, with a prologue and an epilogue
    fused in and `rows` rows of W a thread block. The kernel for one weight type (its
    dequantizer), one prologue (its loads and its arithmetic) and one epilogue, for up to
    x_rows rows of x a thread block (1: a decode step; ROW_GROUP: a verify window, a group
    of its rows in each blockIdx.y). The sizes are compile-time constants so the per-thread arrays
    stay in registers: a 1-row step's kernel holds 4 sums, not 32, and fits more warps on
    an SM to hide the memory's latency. With `rope` the epilogue is y_rope_pair: one
    thread stores each pair of outputs (rows is even, so a pair never straddles blocks);
    with `append_pair` too, that thread writes the k and v pairs into the KV cache."""
    append = append_pair is not None
    append_pair = append_pair or no_append

    @cuda.jit(cache=True)
    def matvec_kernel(x,     # (n, in) float32, n <= 8; (n, 2 in) gated
                      norm,  # (in,) float32 rmsnorm weight (normed), else unused
                      eps,   # float32 (normed)
                      n_in,  # int32: the length of a row of W
                      a,     # (out, *) view a of W's rows (QTYPES)
                      b,     # (out, *) view b of the same bytes
                      y,     # (n, out) float32, written (or added to)
                      cos,   # (n, hd/2) float32 with rope (each row's angles), else unused
                      sin,   # (n, hd/2) float32 with rope, else unused
                      rope_rows,  # int32 with rope: outputs before the v heads, rotated
                      hd,    # int32 with rope: head_dim, a power of two
                      ahead,      # (bytes,) uint8: the next matvec's W, flat, read into L2; size 0 = none
                      ahead_out,  # (threads of the grid,) uint32 with report, else (0,): what was read
                      report,     # int32: 1 = each thread writes the XOR of the bytes it read ahead
                      kv_pos,     # (1,) int32 with append: the step's cell position, else unused
                      page_table,  # (n_blocks,) int32 with append, else unused
                      pool_k, pool_v,   # (n_slots, n_kv, 16, hd) float16/float32 with append
                      host_k, host_v):  # (n_blocks, n_kv, 16, hd) or size 0 (no host copy)
        # --8<-- [start:matvec_waits_first]
        # A dependent launch (fast/dependent_launch.py) may have started this kernel while the
        # one before it runs: wait for it before any other load or store, then let the next
        # kernel be launched while this one works.
        wait_for_inputs()
        let_next_start()
        # --8<-- [end:matvec_waits_first]
        # --8<-- [start:matvec_rows]
        # A thread block takes `rows` rows of W at a time; its threads split the rows' parts
        # between them (thread t: parts t, t + threads, ...), so each has one or two parts
        # per row to load and the loads of all its rows are in flight together.
        t, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = t % WARP, t // WARP
        # --8<-- [end:matvec_rows]
        n, n_out = x.shape[0], y.shape[1]
        # this block's rows of x: r0 .. r0 + x_rows - 1 (row groups). A decode step's kernel
        # (x_rows = 1, a compile-time constant) has r0 = 0 as a constant, so its indexing of x
        # and y folds as it would without row groups
        r0 = cuda.blockIdx.y * x_rows if x_rows > 1 else 0
        n_parts = n_in // PART
        w = cuda.local.array((rows, PART), float32)  # one part of each of the block's rows
        xa = cuda.local.array((x_rows, PART), float32)  # what fetch_x loads for the 8 values of
        xb = cuda.local.array((x_rows, PART), float32)  #   each row of x that a part multiplies
        xs = cuda.local.array(PART, float32)  # those values, as make_x makes them
        acc = cuda.local.array((rows, x_rows), float32)  # this thread's partial sums
        inv = cuda.local.array(x_rows, float32)  # 1 / rms of each row of x (normed)
        squares = cuda.local.array(x_rows, float32)  # this thread's sum of x^2 (normed, first trip)
        per_warp = cuda.shared.array((SUM_WARPS, rows, x_rows), float32)  # each warp's sums
        per_warp_squares = cuda.shared.array((SUM_WARPS, x_rows), float32)
        # --8<-- [start:norm_squares_init]
        # Normed: the rows' norms come from the x values the first trip loads anyway (its
        # threads read every column once), summed with the products: the weights' loads
        # go out first, not after a block-wide reduction of x.
        for r in range(x_rows):
            squares[r] = float32(0.0)
        # --8<-- [end:norm_squares_init]
        # --8<-- [start:read_ahead]
        # Ahead: before its own loads, each thread asks for the first byte of AHEAD 32-byte
        # sectors of the next matvec's weights (the unit L2 caches from HBM), and uses them
        # only after its own work, so they wait in L2 for that launch ("Reading ahead").
        g = cuda.blockIdx.x * n_threads + t
        n_sectors = (ahead.size + SECTOR - 1) // SECTOR
        early = cuda.local.array(AHEAD, uint32)
        for u in range(AHEAD):  # this thread's sectors: g, g + the grid's threads, ...
            sector = g + u * cuda.gridDim.x * n_threads
            early[u] = uint32(ahead[sector * SECTOR]) if sector < n_sectors else uint32(0)
        # --8<-- [end:read_ahead]
        # --8<-- [start:append_position]
        # Appending (one row of x: a decode step): the new cell's position is loaded now, in
        # flight with the weights; its page-table entry once the weights' loads are out,
        # so neither lookup holds them back (cell_home below)
        position = kv_pos[0] if append else 0
        home = (int64(0), int64(0), int32(-1))
        # --8<-- [end:append_position]
        first_trip = True
        # Grid-stride over the rows of W, `rows` at a time: every thread of the block makes
        # the same trips, so each trip's reductions are reached by all of them. The strided
        # loops are while loops: `range(a, b, step)` with a step known only at run time
        # works out its trip count with a 64-bit division, a long routine on a GPU
        # (sm90.wide_divides), before the first trip.
        o0 = cuda.blockIdx.x * rows
        while o0 < n_out:
            for k in range(rows):
                for r in range(x_rows):  # constant trip counts: the arrays stay in registers
                    acc[k, r] = float32(0.0)
            q = t
            while q < n_parts:
                # A trip's loads, x's and every row's weights, are written with no branch
                # between them, so the compiler can send them all out before the first is
                # used: one wait on memory a trip. (A row past the last of W or x reads the
                # last again; its sums are never stored.)
                blk, p = q // PARTS, q % PARTS
                lo, hi = part_runs(nibbles, p)
                lo, hi = blk * QK + lo, blk * QK + hi  # the columns of w[:, 0:4] and w[:, 4:8]
                for r in range(x_rows):
                    rx = min(r0 + r, n - 1)
                    for j in range(4):  # 8 values of x, each used for `rows` weights
                        xa[r, j], xb[r, j] = fetch_x(x, norm, rx, lo + j, n_in)
                        xa[r, 4 + j], xb[r, 4 + j] = fetch_x(x, norm, rx, hi + j, n_in)
                for k in range(rows):
                    row = min(o0 + k, n_out - 1)
                    part(a, b, row, blk, p, w[k])  # the weights are read here, and only here
                for r in range(x_rows):
                    # --8<-- [start:norm_squares]
                    if normed and first_trip:  # x's values, the first of what fetch_normed loads
                        for j in range(4):
                            squares[r] += xa[r, j] * xa[r, j]
                            squares[r] += xa[r, 4 + j] * xa[r, 4 + j]
                    # --8<-- [end:norm_squares]
                    for j in range(PART):
                        xs[j] = make_x(xa[r, j], xb[r, j])
                    for k in range(rows):
                        total = acc[k, r]
                        for j in range(PART):
                            total += w[k, j] * xs[j]
                        acc[k, r] = total
                q += n_threads
            # --8<-- [start:append_home]
            if append and first_trip:
                home = cell_home(position, page_table)
            # --8<-- [end:append_home]
            # Sum the threads' partial sums: within each warp by shuffles, then the warps'
            # sums in warp order, so the result never depends on timing. A one-warp block
            # (a short row; every block under the simulator) stores its sums directly: no
            # barrier, which the simulator pays for dearly. The squares go the same way.
            # --8<-- [start:norm_inv]
            if normed and first_trip:
                for r in range(x_rows):
                    if r0 + r < n:
                        total = warp_sum(squares[r])
                        if n_threads == WARP:
                            inv[r] = inv_rms(total, n_in, eps)
                        elif lane == 0:
                            per_warp_squares[warp, r] = total
            # --8<-- [end:norm_inv]
            for k in range(rows):
                for r in range(x_rows):
                    if r0 + r < n:  # the same for every thread, so the reduction stays collective
                        total = warp_sum(acc[k, r])
                        if normed and n_threads == WARP:
                            total *= inv[r]
                        if n_threads == WARP:
                            if rope:
                                acc[k, r] = total  # stored in pairs below
                            elif lane == 0 and o0 + k < n_out:
                                store_y(y, r0 + r, o0 + k, total)
                        elif lane == 0:
                            per_warp[warp, k, r] = total
            # --8<-- [start:rope_store]
            if rope and n_threads == WARP and lane == 0:
                for k in range(0, rows, 2):
                    for r in range(x_rows):
                        if r0 + r < n and o0 + k < n_out:
                            u0, u1 = y_rope_pair(y, r0 + r, o0 + k, acc[k, r], acc[k + 1, r], cos, sin, rope_rows, hd)
                            if append:
                                append_pair(o0 + k, u0, u1, rope_rows, hd, n_out, home, pool_k, pool_v, host_k, host_v)
            # --8<-- [end:rope_store]
            if n_threads > WARP:  # the same for every thread: the barriers stay collective
                cuda.syncthreads()
                if normed and first_trip:  # every thread: the warps' squares in warp order
                    for r in range(x_rows):
                        if r0 + r < n:
                            total = float32(0.0)
                            for v in range(n_threads // WARP):
                                total += per_warp_squares[v, r]
                            inv[r] = inv_rms(total, n_in, eps)
                if rope:  # thread t stores outputs (rows k and k + 1 of W, row r of x)
                    k, r = 2 * (t // x_rows), t % x_rows
                    if k < rows and r0 + r < n and o0 + k < n_out:
                        t0, t1 = float32(0.0), float32(0.0)
                        for v in range(n_threads // WARP):
                            t0 += per_warp[v, k, r]
                            t1 += per_warp[v, k + 1, r]
                        if normed:
                            t0, t1 = t0 * inv[r], t1 * inv[r]
                        u0, u1 = y_rope_pair(y, r0 + r, o0 + k, t0, t1, cos, sin, rope_rows, hd)
                        if append:
                            append_pair(o0 + k, u0, u1, rope_rows, hd, n_out, home, pool_k, pool_v, host_k, host_v)
                else:
                    k, r = t // x_rows, t % x_rows  # thread t stores output (row k of W, row r of x)
                    if k < rows and r0 + r < n and o0 + k < n_out:
                        total = float32(0.0)
                        for v in range(n_threads // WARP):
                            total += per_warp[v, k, r]
                        if normed:
                            total *= inv[r]
                        store_y(y, r0 + r, o0 + k, total)
                cuda.syncthreads()  # per_warp is read before the next trip writes it
            o0 += cuda.gridDim.x * rows
            first_trip = False
        # --8<-- [start:read_ahead_use]
        read = uint32(0)  # the bytes read ahead are used, or the compiler would drop their loads
        for u in range(AHEAD):
            read ^= early[u]
        if report == 1:
            ahead_out[g] = read
        # --8<-- [end:read_ahead_use]

    return waits_for_inputs(matvec_kernel)


# prologue -> (its loads, its arithmetic, normed)
PROLOGUES = {"plain": (fetch_plain, x_plain, False), "normed": (fetch_normed, x_normed, True),
             "gated": (fetch_gated, x_gated, False)}
# epilogue -> (store, rope, append)
EPILOGUES = {"store": (y_store, False, False), "add": (y_add, False, False), "rope": (y_store, True, False),
             "rope_append": (y_store, True, True)}


def matvec_kernels(rows: int, store=store_cell) -> dict:
    """Every (qtype, prologue, epilogue, rows of x) kernel at `rows` rows of W per block,
    the appending ones over the writer body `store`; Numba compiles each one the first
    time it is launched."""
    append_pair = make_append_pair(store)
    return {(qtype, pro, epi, x_rows): make_matvec_kernel(part, nibbles, fetch_x, make_x, store_y, normed, x_rows,
                                                          rows, rope, append_pair if append else None)
            for qtype, (part, _, _, nibbles) in QTYPES.items()
            for pro, (fetch_x, make_x, normed) in PROLOGUES.items()
            for epi, (store_y, rope, append) in EPILOGUES.items() for x_rows in (1, ROW_GROUP)}


# Built beside the kernels' code, not in the launcher: fast/sm90.py finds a recorded kernel
# among the module-level dispatchers of the module that defines it.
MATVEC_KERNELS = matvec_kernels(ROWS)
# --8<-- [end:matvec_kernel]


# --8<-- [start:read_ahead_ref]
def read_ahead_ref(ahead):  # (out, bytes) uint8: what matvec's `ahead` holds
    """The XOR of the first byte of every 32-byte sector: what a launch's threads read
    ahead, XORed over its grid, when the grid's threads cover every sector."""
    return np.bitwise_xor.reduce(np.ascontiguousarray(ahead).reshape(-1)[::SECTOR].astype(np.uint32))
# --8<-- [end:read_ahead_ref]


def matvec_grid(n_out: int, n_in: int, warps: int | None = None) -> tuple[int, int]:
    """(thread blocks, threads per block) of a matvec launch: `ROWS` rows of W per block
    (grid-strided past MAX_BLOCKS), one part of each row per thread (at most MAX_WARPS)."""
    warps = min(MAX_WARPS, -(-n_in // PART // WARP)) if warps is None else warps
    assert 1 <= warps <= SUM_WARPS, f"{warps} warps per block; the kernel sums at most {SUM_WARPS}"
    return min(-(-n_out // ROWS), MAX_BLOCKS), warps * WARP


def ahead_arrays(dev, ahead, ahead_out, grid_threads: int):
    """A launch's read-ahead arguments on the device: `ahead` (out, bytes) uint8 rows as
    one flat row (size 0: none), and `ahead_out` a uint32 slot per thread of the grid
    (size 0: not reported)."""
    if ahead is None:
        ahead = absent((0,), np.uint8)
    else:
        expect("ahead", ahead, np.uint8, (None, None))
        ahead = dev.read(ahead)
        ahead = ahead.reshape(ahead.size)
    if ahead_out is None:
        return ahead, absent((0,), np.uint32)  # never written
    expect("ahead_out", ahead_out, np.uint32, (grid_threads,))
    return ahead, dev.write(ahead_out)


def matvec_fused(x, raw, qtype, y, norm=None, eps=0.0, swiglu=False, add=False, rope=None, append=None,
                 warps: int | None = None, ahead=None, ahead_out=None):
    """Like matvec_fused_ref, on the device, for 1..8 rows of x. NumPy arguments are moved
    (y is written back); device arguments are used in place. warps: per thread block
    (default: one part of each row per thread, at most MAX_WARPS; tests set it under the
    simulator). ahead: the (out, bytes) uint8 rows of the matrix the next matvec reads,
    read into L2 meanwhile, up to AHEAD 32-byte sectors a thread; ahead_out: a uint32 array
    with a slot per thread of the grid, given the XOR of the bytes each read
    (read_ahead_ref's, XORed over the grid). append: with rope, write k and v into an
    fp16/fp32 cache as well, as kv_append_fp16 would (its arguments after k_new, v_new;
    "Appending in the epilogue")."""
    expect("x", x, np.float32, (None, None))
    assert norm is None or not swiglu, "one prologue at a time: norm or swiglu"
    assert rope is None or not add, "one epilogue at a time: add or rope"
    n = x.shape[0]
    n_in = x.shape[1] // 2 if swiglu else x.shape[1]
    assert not swiglu or x.shape[1] == 2 * n_in, f"gate|up rows have an even length, not {x.shape[1]}"
    assert n <= MAX_ROWS, f"x has {n} rows; matvec_fused takes at most {MAX_ROWS} (use matmul)"
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    if norm is not None:
        expect("norm", norm, np.float32, (n_in,))
    if rope is not None:
        cos, sin, n_heads, n_kv = rope
        expect("cos", cos, np.float32, (n, None))
        hd = 2 * cos.shape[1]
        expect("sin", sin, np.float32, (n, hd // 2))
        assert hd & (hd - 1) == 0, f"head_dim {hd} is not a power of two: the rope epilogue masks by it"
        assert n_out == (n_heads + 2 * n_kv) * hd, f"{n_out} outputs are not q|k|v of {n_heads}+{n_kv}+{n_kv} heads of {hd}"
        assert ROWS % 2 == 0, f"the rope epilogue stores pairs of rows: ROWS = {ROWS} is odd"
    if append is not None:
        assert rope is not None, "the append is the rope epilogue's: q|k|v only"
        assert n == 1, f"the append epilogue writes one row's cell (a decode step), not {n}"
        kv_pos, page_table, pool_k, pool_v, host_k, host_v = append
        expect("positions", kv_pos, np.int32, (n,))
        expect("page_table", page_table, np.int32, (None,))
        host_k, host_v = expect_dest(n_kv, hd, pool_k, pool_v, host_k, host_v)
    if n == 0 or n_out == 0:
        return
    prologue = "normed" if norm is not None else ("gated" if swiglu else "plain")
    blocks, threads = matvec_grid(n_out, n_in, warps)
    x_rows = 1 if n == 1 else ROW_GROUP  # rows of x a thread block takes; the next rows, the next blocks in y
    groups = -(-n // x_rows)
    assert ROWS * x_rows <= threads, "a thread per output stores the sums"
    epilogue = "add" if add else ("store" if rope is None else ("rope" if append is None else "rope_append"))
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        x = dev.read(x)
        norm = x if norm is None else dev.read(norm)  # unread unless normed: any float32 array
        if rope is None:  # unread: any (n, *) float32 arrays
            angles, rope_rows, hd = (x, x), 0, 0
        else:
            angles, rope_rows = (dev.read(cos), dev.read(sin)), (n_heads + n_kv) * hd
        ahead, ahead_out = ahead_arrays(dev, ahead, ahead_out, blocks * threads)
        report = 1 if ahead_out.size else 0
        if append is None:  # unread: any arrays of the types the kernel takes
            cell = absent((0,), np.int32), absent((0,), np.int32), *(absent((0, 1, 1, 1), np.float32),) * 4
        else:
            cell = (dev.read(kv_pos), dev.read(page_table), dev.write(pool_k), dev.write(pool_v), dev.write(host_k),
                    dev.write(host_v))
        kernel = MATVEC_KERNELS[qtype, prologue, epilogue, x_rows]
        kernel[(blocks, groups), threads, stream()](
            x, norm, np.float32(eps), np.int32(n_in), a, b, dev.write(y),  # y is read too, with add
            *angles, np.int32(rope_rows), np.int32(hd), ahead, ahead_out, np.int32(report), *cell)


@twin_of(plain.matvec)
def matvec(x, raw, qtype, y):
    """Plain twin: kernels/dense/matvec.py matvec. The fused kernel with no prologue or
    epilogue: 4 rows of W a thread block, the same sums in another order (within
    dot_tolerance of the plain kernel's)."""
    matvec_fused(x, raw, qtype, y)
