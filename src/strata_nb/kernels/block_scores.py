"""QSA block scores (strata-nb's own, in the spirit of Quest): how much a block could matter.

For query head h and block b, `sum_d max(q_d * kmin_d, q_d * kmax_d)` is an upper bound on
q . k for every cell k of the block (each term takes whichever end of [kmin_d, kmax_d]
makes q_d * k_d larger). A query token reads one set of blocks for all its heads, so its
score for a block is the largest bound over its heads, each head using the bounds of its
GQA group's KV head.

The kernel gives each (query, block) pair a thread block of n_kv x head_dim threads:
thread (g, d) loads dim d of KV head g's bounds, so the block's loads all go out at
once, and one warp sum per query head of the group adds its dims. A decode step scores
512 blocks at 8K of context. One thread per pair, walking 9 heads x 64 dims alone, took
87 us a layer on the H200; one warp per pair, 9.3 us (a warp sum per head, and each
head's loads waiting for the last one's sum).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.kernels.launch import DeviceArgs, expect, stream
from strata_nb.kernels.reduce import NEG_INF, WARP, warp_sum

MAX_WARPS = 32  # n_kv * head_dim threads in a thread block: at most 1,024
MAX_GROUP = 64  # query heads per KV head


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
    # One thread block per (query, block); thread (g, d) takes dim d of KV head g.
    b, i, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    n_heads, hd = q.shape[1], q.shape[2]
    group = n_heads // kmin.shape[1]
    g, d = t // hd, t % hd
    lane, warp = t % WARP, t // WARP
    lo, hi = kmin[b, g, d], kmax[b, g, d]  # every thread's loads in flight at once
    sums = cuda.shared.array((MAX_WARPS, MAX_GROUP), float32)  # [warp, head in group]: its dims' sum
    for h in range(group):
        x = q[i, g * group + h, d]
        s = warp_sum(max(x * lo, x * hi))
        if lane == 0:
            sums[warp, h] = s
    cuda.syncthreads()
    if t == 0:  # each head's bound: its warps' sums in order; the score: the largest bound
        warps_per_head = hd // WARP
        best = NEG_INF
        for h in range(n_heads):
            bound = float32(0.0)
            for w in range(warps_per_head):
                bound += sums[(h // group) * warps_per_head + w, h % group]
            best = max(best, bound)
        scores[i, b] = best
# --8<-- [end:block_scores_kernel]


def block_scores(q, kmin, kmax, scores):
    """Like block_scores_ref (scores agree within float32 summation order: atol 1e-4 * scale)."""
    expect("q", q, np.float32, (None, None, None))
    expect("kmin", kmin, np.float32, (None, None, q.shape[2]))
    expect("kmax", kmax, np.float32, kmin.shape)
    expect("scores", scores, np.float32, (q.shape[0], kmin.shape[0]))
    with DeviceArgs() as dev:
        n_kv, hd = kmin.shape[1], kmin.shape[2]
        assert hd % WARP == 0 and n_kv * hd <= MAX_WARPS * WARP and q.shape[1] // n_kv <= MAX_GROUP, \
            f"no block_scores for {n_kv} KV heads of {hd} dims, {q.shape[1]} query heads"
        block_scores_kernel[(kmin.shape[0], q.shape[0]), n_kv * hd, stream()](
            dev.read(q), dev.read(kmin), dev.read(kmax), dev.write(scores))
