"""QSA block scores (strata-nb's own, in the spirit of Quest): how much a block could matter.

For query head h and block b, `sum_d max(q_d * kmin_d, q_d * kmax_d)` is an upper bound on
q . k for every cell k of the block (each term takes whichever end of [kmin_d, kmax_d]
makes q_d * k_d larger). A query token reads one set of blocks for all its heads, so its
score for a block is the largest bound over its heads, each head using the bounds of its
GQA group's KV head.

The kernel gives each (query, block) pair one warp: lane l sums dims l, l + 32, ... of a
head's bound and a warp sum adds the lanes. A decode step scores 512 blocks at 8K of
context; one thread per pair, walking 9 heads x 64 dims alone, took 87 us a layer on the
H200, one warp per pair takes a few.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.kernels.launch import DeviceArgs, expect, stream
from strata_nb.kernels.reduce import NEG_INF, WARP, warp_sum

WARPS_PER_BLOCK = 4  # (query, block) pairs per thread block


# --8<-- [start:block_scores_ref]
def block_scores_ref(q,       # (n_q, n_heads, hd) float32 (rotated when the format rotates Q)
                     kmin,    # (n_blocks, n_kv, hd) float32
                     kmax,    # (n_blocks, n_kv, hd) float32
                     scores):  # (n_q, n_blocks) float32, written
    n_q, n_heads, hd = q.shape
    group = n_heads // kmin.shape[1]
    kv_of = np.arange(n_heads) // group  # the KV head each query head reads
    lo = q[:, :, None, :] * kmin[:, kv_of].transpose(1, 0, 2)[None]  # (n_q, heads, blocks, hd)
    hi = q[:, :, None, :] * kmax[:, kv_of].transpose(1, 0, 2)[None]
    scores[...] = np.maximum(lo, hi).sum(axis=-1, dtype=np.float32).max(axis=1)
# --8<-- [end:block_scores_ref]


# --8<-- [start:block_scores_kernel]
@cuda.jit
def block_scores_kernel(q, kmin, kmax, scores):
    # One warp per (query, block): lane l takes dims l, l + 32, ...; a warp sum per head.
    lane = cuda.threadIdx.x % WARP
    pair = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // WARP
    n_q, n_heads, hd = q.shape
    n_blocks = kmin.shape[0]
    group = n_heads // kmin.shape[1]
    live = pair < n_q * n_blocks  # a warp past the end still joins the warp sums
    i, b = (pair // n_blocks, pair % n_blocks) if live else (0, 0)
    best = NEG_INF
    for h in range(n_heads):
        g = h // group
        part = float32(0.0)
        for d in range(lane, hd, WARP):
            part += max(q[i, h, d] * kmin[b, g, d], q[i, h, d] * kmax[b, g, d])
        best = max(best, warp_sum(part))
    if live and lane == 0:
        scores[i, b] = best
# --8<-- [end:block_scores_kernel]
# --8<-- [end:block_scores_kernel]


def block_scores(q, kmin, kmax, scores):
    """Like block_scores_ref (scores agree within float32 summation order: atol 1e-4 * scale)."""
    expect("q", q, np.float32, (None, None, None))
    expect("kmin", kmin, np.float32, (None, None, q.shape[2]))
    expect("kmax", kmax, np.float32, kmin.shape)
    expect("scores", scores, np.float32, (q.shape[0], kmin.shape[0]))
    with DeviceArgs() as dev:
        pairs = q.shape[0] * kmin.shape[0]
        block_scores_kernel[(pairs + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, WARPS_PER_BLOCK * WARP, stream()](
            dev.read(q), dev.read(kmin), dev.read(kmax), dev.write(scores))
