"""y = x @ W.T for a few activation rows, W read once in its GGUF quantized form: the decode
hot path (a decode step is 1 row of x, a verify window up to 8).

Index legend: n activation rows (1..8), in = the row length of x and W, out = rows of W.

The file reads top down: `matvec_ref`, the spec, and its tolerance; the per-type
dequantizers both kernels call; `matvec_kernel1`, the plain kernel (a warp per row of W,
nothing fused) with its launcher `matvec1`; then the fused kernel the engine runs, built
by `make_matvec_kernel`, and its launcher `matvec`.

Why this is a bandwidth problem. A decode step multiplies each weight once, so its time
is the time to read the weights (the default model's 92 MiB a token), and arithmetic is
cheap next to that. Both kernels are shaped around the reads: a lane handles a *part*,
8 of the 32 values of a quantization block, so 4 neighbouring lanes cover one block and
a warp's loads fall on one contiguous run of the row (coalesced); every row of x is
summed from that one read of W, so a verify window costs the weight reads of one step.

The fused kernel. The plain kernel gives each row of W one warp; the fused one differs
in what would otherwise cost a launch or leave loads waiting:

- a thread block works on ROWS = 4 rows of W at once and its warps split each row's
  parts between them, so every thread has one or two parts per row and its loads of all
  4 rows are in flight together, each value of x it loads serving 4 weights; a 1-row
  step compiles its own kernel (4 sums a thread, not 32), whose smaller register count
  fits more warps on an SM;
- a *prologue* decides what it multiplies: x, rmsnorm(x) or swiglu(gate|up) (the forward
  pass's `normed_matmul`, `gated_matmul_add_`), so no norm or gate launch precedes it;
- an *epilogue* stores y, adds it to the residual (`matmul_add_`), or stores q|k|v with
  RoPE applied to the q and k heads (`normed_matmul_rope`), and in a decode step with
  an fp16/fp32 cache also writes k and v into the new cell;
- before its own loads it reads the first bytes of the next matvec's weights into L2.

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

The dequantizers are small device functions with one signature, `part(a, b, blk, p, w)`:
a and b are two views of one weight row (see QTYPES), blk the 32-value block, p the part
(0..3), and w the part's 8 values, written. matmul.py (prefill) and embed.py reuse them.
Dequantization is exact in float32 (a 4- or 8-bit code times an fp16 scale fits in 24
bits; Q4_1's `+ m` rounds once, fused or not), so kernel and reference multiply the same
weights.

Tolerance. A kernel and the reference (`x @ dequantize(raw, qtype).T`, float32 BLAS) sum
the same `in` products in different orders: a kernel adds in/32 products per lane one
after another, then a 5-level tree over lanes; BLAS in its own blocked order. Any
float32 summation of k products is within (k + 1) * u * sum_i |x_i w_i| of the exact
value (u = 2^-24; first order, whatever the order), so the two are within
`dot_tolerance` = 2 (in + 1) u sum_i |x_i| |w_i| of each other, output by output. It is
loose (random rounding errors grow like sqrt(k)), and still below what a real bug costs:
one wrong scale moves 32 products, ~32 sum/in, which is 16 / (u in^2) times the bound.

A fused prologue computes the activations itself, so they may differ from
rmsnorm_ref's or swiglu_ref's by those kernels' own tolerances ((in + 8) u and 16 u,
relatively); through the product that adds rtol * sum_i |x_i| |w_i| (`fused_tolerance`).
The normed kernel's 1 / rms has rmsnorm's error, and scaling the sum rounds once more
(u |y|, with |y| <= sum_i |x_i| |w_i|), against the one rounding of x * inv it saves per
value: within the same bound. A fused add rounds once more on each side: 2 u |y| more.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from strata_nb.kernels.kv.kv_append_fp16 import cell_home, expect_dest, kv_append_fp16_ref, store_cell
from strata_nb.gpu.launch import DeviceArgs, absent, expect, stream
from strata_nb.gpu.geometry import MATVEC_MAX_BLOCKS, MATVEC_MAX_WARPS
from strata_nb.kernels.kv.quant_q4_0 import mul_rn
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.rmsnorm import inv_rms, rmsnorm_ref
from strata_nb.kernels.dense.rope import rope_qkv_ref
from strata_nb.kernels.dense.swiglu import swiglu_ref
from strata_nb.model.dequant import dequantize

QK = 32  # values per quantization block; F16/F32 rows are cut into 32-value blocks too
PARTS = 4  # lanes per block
PART = QK // PARTS  # 8 values per lane per block
MAX_ROWS = 8  # activation rows per call: a decode step (1) or a verify window (<= 8)
ROWS = 4  # rows of W a thread block works through together
# The fused kernel's warps per thread block: enough for one part of each row per thread,
# at most 8; thread blocks at most 16 per SM of an H200 (a larger W is grid-strided, so
# the output head's norm is worked out once per thread block, not once per 4 rows). The
# simulator runs every CUDA thread as a Python thread and wakes them one by one at every
# barrier: one warp striding over all rows costs the least there.
MAX_WARPS, MAX_BLOCKS = MATVEC_MAX_WARPS, MATVEC_MAX_BLOCKS
SUM_WARPS = 8  # rows of the shared array the warps' sums meet in
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "F32": 128}  # bytes per 32 values
U = 2.0 ** -24  # float32 unit roundoff
SECTOR = 32  # bytes: what L2 caches from HBM at a time
AHEAD = 4  # sectors of the next matvec's rows each thread reads ahead


# --8<-- [start:matvec_ref]
def matvec_ref(x,      # (n, in) float32; (n, 2 in) with swiglu: gate values, then up values
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
        y += x @ dequantize(raw, qtype).T
    elif rope is not None:
        cos, sin, n_heads, n_kv = rope
        n, hd = x.shape[0], 2 * cos.shape[1]
        q, k, v = (np.empty((n, heads, hd), np.float32) for heads in (n_heads, n_kv, n_kv))
        rope_qkv_ref(x @ dequantize(raw, qtype).T, cos, sin, q, k, v)
        y[...] = np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1)
        if append is not None:
            kv_append_fp16_ref(k, v, *append)
    else:
        y[...] = x @ dequantize(raw, qtype).T


def prologue_ref(x, norm, eps, swiglu):
    """The activations matvec multiplies: x, rmsnorm(x) or swiglu(x)."""
    if norm is not None:
        normed = np.empty_like(x)
        rmsnorm_ref(x, norm, eps, normed)
        return normed
    if swiglu:
        gated = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
        swiglu_ref(x, gated)
        return gated
    return x


def dot_tolerance(x, w):
    """(n, out) float64: how far kernel and reference may differ (module docstring)."""
    x64, w64 = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    return 2 * (x.shape[1] + 1) * U * (x64 @ w64.T)


def fused_tolerance(x, w, norm=None, eps=0.0, swiglu=False):
    """dot_tolerance of the activations the kernel multiplies, plus what its own rmsnorm or
    swiglu may differ by from the reference's, carried through |W| (module docstring)."""
    xs = prologue_ref(x, norm, eps, swiglu)
    prologue_rtol = (x.shape[1] + 8) * U if norm is not None else (16 * U if swiglu else 0.0)
    return dot_tolerance(xs, w) + prologue_rtol * (np.abs(xs.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
# --8<-- [end:matvec_ref]


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


@cuda.jit(device=True)
def part_q4_0(a,    # (in/32 * 9,) uint16: one row; block blk = d, then 8 halves of codes
              b,    # (in/32 * 9,) float16: the same bytes
              blk, p, w):
    d = float32(b[9 * blk])
    for h in range(2):
        pair = a[9 * blk + 1 + 2 * p + h]  # code bytes 4p + 2h and 4p + 2h + 1
        for i in range(2):
            byte = (pair >> (8 * i)) & 0xFF
            j = 2 * h + i
            # Subtract in float32 (exact for 0..15): an unsigned code minus 8 would wrap.
            w[j] = (float32(byte & 0x0F) - float32(8.0)) * d
            w[4 + j] = (float32(byte >> 4) - float32(8.0)) * d


@cuda.jit(device=True)
def part_q4_1(a,    # (in/32 * 5,) uint32: one row; block blk = (d, m), then 4 words of codes
              b,    # (in/32 * 10,) float16: the same bytes
              blk, p, w):
    d, m = float32(b[10 * blk]), float32(b[10 * blk + 1])
    word = a[5 * blk + 1 + p]  # code bytes 4p..4p+3, one 4-byte load
    for j in range(4):
        byte = (word >> (8 * j)) & 0xFF
        w[j] = float32(byte & 0x0F) * d + m
        w[4 + j] = float32(byte >> 4) * d + m


@cuda.jit(device=True)
def part_q8_0(a,    # (in/32 * 17,) int16: one row; block blk = d, then 16 pairs of int8 codes
              b,    # (in/32 * 17,) float16: the same bytes
              blk, p, w):
    d = float32(b[17 * blk])
    for h in range(4):
        # code bytes 8p + 2h (the low byte) and 8p + 2h + 1 (the high byte) as one signed
        # 16-bit pair: shifts bring out each int8 with its sign, with no compare
        pair = int64(a[17 * blk + 1 + 4 * p + h])
        w[2 * h] = float32((pair << 56) >> 56) * d
        w[2 * h + 1] = float32(pair >> 8) * d


@cuda.jit(device=True)
def part_f16(a,    # (in,) float16: one row
             b,    # unused (the same array)
             blk, p, w):
    for j in range(PART):
        w[j] = float32(a[QK * blk + PART * p + j])


@cuda.jit(device=True)
def part_f32(a,    # (in,) float32: one row
             b,    # unused (the same array)
             blk, p, w):
    for j in range(PART):
        w[j] = a[QK * blk + PART * p + j]


# qtype: (dequantizer, view a, view b, 4-bit nibble layout)
QTYPES = {
    "Q4_0": (part_q4_0, np.uint16, np.float16, True),
    "Q4_1": (part_q4_1, np.uint32, np.float16, True),
    "Q8_0": (part_q8_0, np.int16, np.float16, False),
    "F16": (part_f16, np.float16, np.float16, False),
    "F32": (part_f32, np.float32, np.float32, False),
}
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


# --8<-- [start:matvec_kernel1]
def make_matvec_kernel1(part, nibbles):
    """The plain kernel for one weight type (its dequantizer `part`): one warp per row of
    W, each lane dequantizing every 32nd part of the row and multiplying it with every
    row of x; nothing fused, no rows of W shared between warps."""

    @cuda.jit
    def matvec_kernel1(x,     # (n, in) float32, n <= MAX_ROWS
                       n_in,  # int32: the length of a row of W
                       a,     # (out, *) view a of W's rows (QTYPES)
                       b,     # (out, *) view b of the same bytes
                       y):    # (n, out) float32, written
        o = cuda.blockIdx.x  # the row of W; the thread block is one warp
        lane = cuda.threadIdx.x
        w = cuda.local.array(PART, float32)  # 8 weights of the row, dequantized
        acc = cuda.local.array(MAX_ROWS, float32)  # this lane's sum for each row of x
        for r in range(MAX_ROWS):
            acc[r] = float32(0.0)
        # Lane l takes parts l, l + 32, ...: each round the warp's 32 parts are 8 whole
        # blocks side by side, so its loads fall on one contiguous run of the row.
        for q in range(lane, n_in // PART, WARP):
            blk, p = q // PARTS, q % PARTS
            part(a[o], b[o], blk, p, w)
            lo, hi = part_runs(nibbles, p)  # the columns of w[0:4] and w[4:8] in the block
            lo, hi = blk * QK + lo, blk * QK + hi
            for r in range(x.shape[0]):
                for j in range(4):
                    acc[r] += w[j] * x[r, lo + j] + w[4 + j] * x[r, hi + j]
        for r in range(x.shape[0]):
            total = warp_sum(acc[r])  # the 32 lanes' sums, in every lane
            if lane == 0:
                y[r, o] = total

    return matvec_kernel1


MATVEC_KERNELS1 = {qtype: make_matvec_kernel1(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:matvec_kernel1]


def matvec1(x, raw, qtype, y):
    """Like matvec_ref without fusions, with the plain kernel: a warp per row of W. NumPy
    arguments are moved (y is written back); device arguments are used in place."""
    expect("x", x, np.float32, (None, None))
    n, n_in = x.shape
    assert n <= MAX_ROWS, f"x has {n} rows; matvec1 takes at most {MAX_ROWS} (use matmul)"
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, n_in)))
    n_out = raw.shape[0]
    expect("y", y, np.float32, (n, n_out))
    if n == 0 or n_out == 0:
        return
    with DeviceArgs() as dev:
        a, b = weight_views(dev.read(raw), qtype)
        MATVEC_KERNELS1[qtype][n_out, WARP, stream()](dev.read(x), np.int32(n_in), a, b, dev.write(y))


# ---- the fused kernel the engine runs ---------------------------------------------------
# What it adds to the plain kernel, each marked as a region the GPU pages include:
#   rows of W and warps per thread block  matvec_rows
#   the norm prologue     norm_prologue, norm_squares_init, norm_squares, norm_inv
#   the swiglu prologue   swiglu_prologue
#   the add epilogue      add_epilogue
#   the rope epilogue     rope_epilogue, rope_store
#   the append epilogue   append_pair, append_position, append_home
#   the read ahead        read_ahead, read_ahead_use, read_ahead_ref


# --8<-- [start:matvec_prologues]
# What the kernel multiplies by W, value x[r, col] of the row it reads: all take
# (x, norm, r, col, n_in). A normed kernel multiplies x * norm and applies 1 / rms to
# each output's sum (rmsnorm(x) W = (1 / rms) (x * norm) W).
@cuda.jit(device=True)
def x_plain(x, norm, r, col, n_in):
    return x[r, col]


# --8<-- [start:norm_prologue]
@cuda.jit(device=True)
def x_normed(x, norm, r, col, n_in):
    return x[r, col] * norm[col]  # times 1 / rms, which the kernel applies to the sum
# --8<-- [end:norm_prologue]


# --8<-- [start:swiglu_prologue]
@cuda.jit(device=True)
def x_gated(x, norm, r, col, n_in):
    g, u = x[r, col], x[r, n_in + col]  # the gate and up halves of gate|up
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
def make_matvec_kernel(part, nibbles, load_x, store_y, normed, x_rows, rows, rope=False, append_pair=None):
    """The kernel for one weight type (its dequantizer), one prologue and one epilogue,
    for up to x_rows rows of x (1: a decode step; MAX_ROWS: a verify window), `rows` rows
    of W per thread block. The sizes are compile-time constants so the per-thread arrays
    stay in registers: a 1-row step's kernel holds 4 sums, not 32, and fits more warps on
    an SM to hide the memory's latency. With `rope` the epilogue is y_rope_pair: one
    thread stores each pair of outputs (rows is even, so a pair never straddles blocks);
    with `append_pair` too, that thread writes the k and v pairs into the KV cache."""
    append = append_pair is not None
    append_pair = append_pair or no_append

    @cuda.jit
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
        # --8<-- [start:matvec_rows]
        # A thread block takes `rows` rows of W at a time; its threads split the rows' parts
        # between them (thread t: parts t, t + threads, ...), so each has one or two parts
        # per row to load and the loads of all its rows are in flight together.
        t, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = t % WARP, t // WARP
        # --8<-- [end:matvec_rows]
        n, n_out = x.shape[0], y.shape[1]
        n_parts = n_in // PART
        w = cuda.local.array((rows, PART), float32)  # one part of each of the block's rows
        xs = cuda.local.array(PART, float32)  # the 8 values of a row of x that part multiplies
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
                blk, p = q // PARTS, q % PARTS
                for k in range(rows):
                    if o0 + k < n_out:
                        part(a[o0 + k], b[o0 + k], blk, p, w[k])  # the weights are read here, and only here
                    else:  # past the last row: zeros, whose sums are never stored
                        for j in range(PART):
                            w[k, j] = float32(0.0)
                lo, hi = part_runs(nibbles, p)
                lo, hi = blk * QK + lo, blk * QK + hi  # the columns of w[:, 0:4] and w[:, 4:8]
                for r in range(x_rows):
                    if r < n:
                        for j in range(4):  # 8 values of x, each used for `rows` weights
                            xs[j] = load_x(x, norm, r, lo + j, n_in)
                            xs[4 + j] = load_x(x, norm, r, hi + j, n_in)
                        # --8<-- [start:norm_squares]
                        if normed and first_trip:
                            for j in range(4):
                                squares[r] += x[r, lo + j] * x[r, lo + j]
                                squares[r] += x[r, hi + j] * x[r, hi + j]
                        # --8<-- [end:norm_squares]
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
                    if r < n:
                        total = warp_sum(squares[r])
                        if n_threads == WARP:
                            inv[r] = inv_rms(total, n_in, eps)
                        elif lane == 0:
                            per_warp_squares[warp, r] = total
            # --8<-- [end:norm_inv]
            for k in range(rows):
                for r in range(x_rows):
                    if r < n:  # n is the same for every thread, so the reduction stays collective
                        total = warp_sum(acc[k, r])
                        if normed and n_threads == WARP:
                            total *= inv[r]
                        if n_threads == WARP:
                            if rope:
                                acc[k, r] = total  # stored in pairs below
                            elif lane == 0 and o0 + k < n_out:
                                store_y(y, r, o0 + k, total)
                        elif lane == 0:
                            per_warp[warp, k, r] = total
            # --8<-- [start:rope_store]
            if rope and n_threads == WARP and lane == 0:
                for k in range(0, rows, 2):
                    for r in range(x_rows):
                        if r < n and o0 + k < n_out:
                            u0, u1 = y_rope_pair(y, r, o0 + k, acc[k, r], acc[k + 1, r], cos, sin, rope_rows, hd)
                            if append:
                                append_pair(o0 + k, u0, u1, rope_rows, hd, n_out, home, pool_k, pool_v, host_k, host_v)
            # --8<-- [end:rope_store]
            if n_threads > WARP:  # the same for every thread: the barriers stay collective
                cuda.syncthreads()
                if normed and first_trip:  # every thread: the warps' squares in warp order
                    for r in range(x_rows):
                        if r < n:
                            total = float32(0.0)
                            for v in range(n_threads // WARP):
                                total += per_warp_squares[v, r]
                            inv[r] = inv_rms(total, n_in, eps)
                if rope:  # thread t stores outputs (rows k and k + 1 of W, row r of x)
                    k, r = 2 * (t // x_rows), t % x_rows
                    if k < rows and r < n and o0 + k < n_out:
                        t0, t1 = float32(0.0), float32(0.0)
                        for v in range(n_threads // WARP):
                            t0 += per_warp[v, k, r]
                            t1 += per_warp[v, k + 1, r]
                        if normed:
                            t0, t1 = t0 * inv[r], t1 * inv[r]
                        u0, u1 = y_rope_pair(y, r, o0 + k, t0, t1, cos, sin, rope_rows, hd)
                        if append:
                            append_pair(o0 + k, u0, u1, rope_rows, hd, n_out, home, pool_k, pool_v, host_k, host_v)
                else:
                    k, r = t // x_rows, t % x_rows  # thread t stores output (row k of W, row r of x)
                    if k < rows and r < n and o0 + k < n_out:
                        total = float32(0.0)
                        for v in range(n_threads // WARP):
                            total += per_warp[v, k, r]
                        if normed:
                            total *= inv[r]
                        store_y(y, r, o0 + k, total)
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

    return matvec_kernel


PROLOGUES = {"plain": (x_plain, False), "normed": (x_normed, True), "gated": (x_gated, False)}
# epilogue -> (store, rope, append)
EPILOGUES = {"store": (y_store, False, False), "add": (y_add, False, False), "rope": (y_store, True, False),
             "rope_append": (y_store, True, True)}


def matvec_kernels(rows: int, store=store_cell) -> dict:
    """Every (qtype, prologue, epilogue, rows of x) kernel at `rows` rows of W per block,
    the appending ones over the writer body `store`; Numba compiles each one the first
    time it is launched."""
    append_pair = make_append_pair(store)
    return {(qtype, pro, epi, x_rows): make_matvec_kernel(part, nibbles, load_x, store_y, normed, x_rows, rows,
                                                          rope, append_pair if append else None)
            for qtype, (part, _, _, nibbles) in QTYPES.items()
            for pro, (load_x, normed) in PROLOGUES.items()
            for epi, (store_y, rope, append) in EPILOGUES.items() for x_rows in (1, MAX_ROWS)}


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


def matvec(x, raw, qtype, y, norm=None, eps=0.0, swiglu=False, add=False, rope=None, append=None,
           warps: int | None = None, ahead=None, ahead_out=None):
    """Like matvec_ref, on the device, for 1..8 rows of x. NumPy arguments are moved (y is
    written back); device arguments are used in place. warps: per thread block (default:
    one part of each row per thread, at most MAX_WARPS; tests set it under the simulator).
    ahead: the (out, bytes) uint8 rows of the matrix the next matvec reads, read into L2
    meanwhile, up to AHEAD 32-byte sectors a thread; ahead_out: a uint32 array with a slot
    per thread of the grid, given the XOR of the bytes each read (read_ahead_ref's, XORed
    over the grid). append: with rope, write k and v into an fp16/fp32 cache as well, as
    kv_append_fp16 would (its arguments after k_new, v_new; "Appending in the epilogue")."""
    expect("x", x, np.float32, (None, None))
    assert norm is None or not swiglu, "one prologue at a time: norm or swiglu"
    assert rope is None or not add, "one epilogue at a time: add or rope"
    n = x.shape[0]
    n_in = x.shape[1] // 2 if swiglu else x.shape[1]
    assert not swiglu or x.shape[1] == 2 * n_in, f"gate|up rows have an even length, not {x.shape[1]}"
    assert n <= MAX_ROWS, f"x has {n} rows; matvec takes at most {MAX_ROWS} (use matmul)"
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
    x_rows = 1 if n == 1 else MAX_ROWS
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
        if ahead is None:
            ahead = absent((0,), np.uint8)
        else:
            expect("ahead", ahead, np.uint8, (None, None))
            ahead = dev.read(ahead)
            ahead = ahead.reshape(ahead.size)
        if ahead_out is None:
            ahead_out, report = absent((0,), np.uint32), 0  # never written
        else:
            expect("ahead_out", ahead_out, np.uint32, (blocks * threads,))
            ahead_out, report = dev.write(ahead_out), 1
        if append is None:  # unread: any arrays of the types the kernel takes
            cell = absent((0,), np.int32), absent((0,), np.int32), *(absent((0, 1, 1, 1), np.float32),) * 4
        else:
            cell = (dev.read(kv_pos), dev.read(page_table), dev.write(pool_k), dev.write(pool_v), dev.write(host_k),
                    dev.write(host_v))
        kernel = MATVEC_KERNELS[qtype, prologue, epilogue, x_rows]
        kernel[blocks, threads, stream()](
            x, norm, np.float32(eps), np.int32(n_in), a, b, dev.write(y),  # y is read too, with add
            *angles, np.int32(rope_rows), np.int32(hd), ahead, ahead_out, np.int32(report), *cell)
