"""RMS norm: each row of x scaled to unit root-mean-square, then by a learned weight.

    out[i] = x[i] * 1 / sqrt(mean(x[i]^2) + eps) * w

One thread block per row: its threads each add the squares of a strided share of the row
(neighbouring threads, neighbouring values: coalesced), `block_sum` (gpu/reduce.py)
combines them, and every thread then scales its share. The row is read twice; at d = 576
both reads hit the cache.

Tolerance: the only difference from the reference is the order of the float32 sum of
squares (the reference's pairwise sum against per-thread runs and a tree). A float32 sum
of d non-negative terms is within (d - 1) u of the exact value, relatively, in any order
(u = 2^-24), so the two sums differ by at most 2 (d - 1) u relatively; the square root
halves that, and the other roundings on each side (the mean, + eps, the square root, the
reciprocal, two products: 6 each) keep the two within 9 u more. So
|out - ref| <= (d + 8) u |ref|: `rmsnorm_tolerance`. (Both sums are in fact far closer
than (d - 1) u: pairwise and per-thread runs of d / 32 terms; the bound needs no guess
about either order.)

Per-head RMS norm (Gemma 3's QK-norm): the fused q|k|v product's rows, each q head's hd
values normed with q_norm and each k head's with k_norm, the v heads copied. Each head is
a row of hd values to rmsnorm_ref, and the kernel takes one thread block per (head, row),
so the bound is the same with d = hd: `rmsnorm_tolerance` of the (n, heads, hd) view.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.geometry import RMSNORM_THREADS
from strata_nb.gpu.reduce import block_sum

# Threads per row: 4 warps on a GPU; one warp under the simulator, where each thread is a
# Python thread and each barrier waits for all of them.
THREADS = RMSNORM_THREADS
U = 2.0 ** -24  # float32 unit roundoff


# --8<-- [start:rmsnorm_ref]
def rmsnorm_ref(x,    # (n, d) float32
                w,    # (d,) float32
                eps,  # float
                out):  # (n, d) float32, written
    ms = np.mean(x * x, axis=-1, keepdims=True)
    out[...] = x * (1.0 / np.sqrt(ms + np.float32(eps))) * w


def rmsnorm_tolerance(ref):
    """|kernel - ref| bound, elementwise (module docstring)."""
    return (ref.shape[-1] + 8) * U * np.abs(ref)
# --8<-- [end:rmsnorm_ref]


# --8<-- [start:rmsnorm_kernel]
@cuda.jit(device=True)
def inv_rms(sum_squares, d, eps):
    """1 / sqrt(mean + eps) from a row's float32 sum of squares over d values (matvec's
    normed kernels use it too)."""
    return float32(1.0) / math.sqrt(sum_squares / float32(d) + eps)


@cuda.jit(device=True)
def norm_row(x, i, start, d, w, eps, out):
    """The thread block's row: out[i, start:start + d] = x[i, start:start + d] normed, times w."""
    squares = float32(0.0)
    for j in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        squares += x[i, start + j] * x[i, start + j]
    total = block_sum(squares)  # every thread of the block gets the row's sum
    inv = inv_rms(total, d, eps)
    for j in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        out[i, start + j] = x[i, start + j] * inv * w[j]


@cuda.jit(cache=True)
def rmsnorm_kernel(x,    # (n, d) float32
                   w,    # (d,) float32
                   eps,  # float32
                   out):  # (n, d) float32, written
    norm_row(x, cuda.blockIdx.x, 0, x.shape[1], w, eps, out)  # a thread block per row
# --8<-- [end:rmsnorm_kernel]


def rmsnorm(x, w, eps, out):
    """Like rmsnorm_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("x", x, np.float32, (None, None))
    n, d = x.shape
    expect("w", w, np.float32, (d,))
    expect("out", out, np.float32, (n, d))
    if n == 0:
        return
    with DeviceArgs() as dev:
        rmsnorm_kernel[n, THREADS, stream()](dev.read(x), dev.read(w), np.float32(eps), dev.write(out))


# --8<-- [start:head_rmsnorm_ref]
def head_rmsnorm_ref(qkv,      # (n, (n_heads + 2 n_kv) hd) float32: q heads, then k heads, then v heads
                     q_norm,   # (hd,) float32
                     k_norm,   # (hd,) float32
                     eps,      # float
                     n_heads,  # int
                     n_kv,     # int
                     out):     # qkv's shape, float32, C-contiguous, written
    hd = q_norm.shape[0]
    heads = qkv.reshape(qkv.shape[0], -1, hd)  # (n, n_heads + 2 n_kv, hd) views: rmsnorm_ref
    normed = out.reshape(heads.shape)          # norms along the last axis, so a head is a row
    q, k, v = slice(0, n_heads), slice(n_heads, n_heads + n_kv), slice(n_heads + n_kv, None)
    rmsnorm_ref(heads[:, q], q_norm, eps, normed[:, q])
    rmsnorm_ref(heads[:, k], k_norm, eps, normed[:, k])
    normed[:, v] = heads[:, v]
# --8<-- [end:head_rmsnorm_ref]


# --8<-- [start:head_rmsnorm_kernel]
@cuda.jit(cache=True)
def head_rmsnorm_kernel(qkv, q_norm, k_norm,  # shapes as head_rmsnorm_ref
                        eps,                  # float32
                        n_heads, n_kv,        # int
                        out):                 # qkv's shape, float32, written
    h, i = cuda.blockIdx.x, cuda.blockIdx.y  # one head of one row
    hd = q_norm.shape[0]
    start = h * hd  # the head's first column
    if h >= n_heads + n_kv:  # a v head: copied (the whole block leaves, so no barrier waits for it)
        for j in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
            out[i, start + j] = qkv[i, start + j]
        return
    norm_row(qkv, i, start, hd, q_norm if h < n_heads else k_norm, eps, out)  # a q or k head: rmsnorm_kernel's row
# --8<-- [end:head_rmsnorm_kernel]


def head_rmsnorm(qkv, q_norm, k_norm, eps, n_heads, n_kv, out):
    """Like head_rmsnorm_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("q_norm", q_norm, np.float32, (None,))
    hd = q_norm.shape[0]
    expect("k_norm", k_norm, np.float32, (hd,))
    expect("qkv", qkv, np.float32, (None, (n_heads + 2 * n_kv) * hd))
    expect("out", out, np.float32, qkv.shape)
    if qkv.shape[0] == 0:
        return
    with DeviceArgs() as dev:
        head_rmsnorm_kernel[(n_heads + 2 * n_kv, qkv.shape[0]), THREADS, stream()](
            dev.read(qkv), dev.read(q_norm), dev.read(k_norm), np.float32(eps), n_heads, n_kv, dev.write(out))
