"""y = x @ W.T for a few activation rows, W read once in its GGUF quantized form: the decode
hot path (a decode step is 1 row of x, a verify window up to 8).

Index legend: n activation rows (1..8), in = the row length of x and W, out = rows of W.

The matvec is three files, read in this order:

- gguf_rows.py: how a row of W is stored, and the device dequantizers every dense kernel
  calls to turn one part of a row into float32;
- this file, top down: `matvec_ref`, the spec, and its tolerance; `matvec_kernel1`, the
  plain kernel (a warp per row of W, nothing fused) with its launcher `matvec1`; then
  `matvec`, which checks its arguments and launches the fused kernel the engine runs;
- matvec_fused.py: that fused kernel, built by `make_matvec_kernel`. A decode step puts
  small ops around each product (the norm before q|k|v, RoPE and the KV append after it,
  SwiGLU before down, the residual add after o and down); each one folded into the matvec
  as a prologue or an epilogue is a launch saved. Its thread blocks also take 4 rows of W
  at a time and read the next matrix into L2 ahead, so more weight loads are in flight.

Why this is a bandwidth problem. A decode step multiplies each weight once, so its time
is the time to read the weights (the default model's 92 MiB a token), and arithmetic is
cheap next to that. Both kernels are shaped around the reads: a lane handles a *part*,
8 of the 32 values of a quantization block, so 4 neighbouring lanes cover one block and
a warp's loads fall on one contiguous run of the row (coalesced); every row of x is
summed from that one read of W, so a verify window costs the weight reads of one step.

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

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import MATVEC_MAX_BLOCKS, MATVEC_MAX_WARPS
from strata_nb.gpu.launch import DeviceArgs, absent, expect, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_bytes, weight_views
from strata_nb.kernels.dense.matvec_fused import MATVEC_KERNELS, MAX_ROWS, ROW_GROUP, ROWS, SUM_WARPS
from strata_nb.kernels.dense.rmsnorm import rmsnorm_ref
from strata_nb.kernels.dense.rope import rope_qkv_ref
from strata_nb.kernels.dense.swiglu import swiglu_ref
from strata_nb.kernels.kv.kv_append_fp16 import expect_dest, kv_append_fp16_ref
from strata_nb.model.dequant import dequantize

# The fused kernel's warps per thread block: enough for one part of each row per thread,
# at most 8; thread blocks at most 16 per SM of an H200 (a larger W is grid-strided, so
# the output head's norm is worked out once per thread block, not once per 4 rows). The
# simulator runs every CUDA thread as a Python thread and wakes them one by one at every
# barrier: one warp striding over all rows costs the least there.
MAX_WARPS, MAX_BLOCKS = MATVEC_MAX_WARPS, MATVEC_MAX_BLOCKS
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


# --8<-- [start:matvec_kernel1]
def make_matvec_kernel1(part, nibbles):
    """The plain kernel for one weight type (its dequantizer `part`): one warp per row of
    W, each lane dequantizing every 32nd part of the row and multiplying it with every
    row of x; nothing fused, no rows of W shared between warps."""

    @cuda.jit(cache=True)
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
            part(a, b, o, blk, p, w)
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


# The fused kernel's launch: matvec_fused.py's MATVEC_KERNELS holds one kernel per (weight
# type, prologue, epilogue, rows of x); `matvec` checks its arguments and picks one.
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


def matvec(x, raw, qtype, y, norm=None, eps=0.0, swiglu=False, add=False, rope=None, append=None,
           warps: int | None = None, ahead=None, ahead_out=None):
    """Like matvec_ref, on the device, for 1..8 rows of x. NumPy arguments are moved (y is
    written back); device arguments are used in place. warps: per thread block (default:
    one part of each row per thread, at most MAX_WARPS; tests set it under the simulator).
    ahead: the (out, bytes) uint8 rows of the matrix the next matvec reads, read into L2
    meanwhile, up to AHEAD 32-byte sectors a thread; ahead_out: a uint32 array with a slot
    per thread of the grid, given the XOR of the bytes each read (read_ahead_ref's, XORed
    over the grid). append: with rope, write k and v into an fp16/fp32 cache as well, as
    kv_append_fp16 would (its arguments after k_new, v_new; "Appending in the epilogue" in
    matvec_fused.py)."""
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
