"""QSA block scores (strata-nb's own, in the spirit of Quest): how much a block could matter.

For query head h and block b, `sum_d max(q_d * kmin_d, q_d * kmax_d)` is an upper bound on
q . k for every cell k of the block (each term takes whichever end of [kmin_d, kmax_d]
makes q_d * k_d larger). A query token reads one set of blocks for all its heads, so its
score for a block is the largest bound over its heads, each head using the bounds of its
GQA group's KV head.

One warp scores one (query, block) pair: lane l takes dims l, l + 32, ... of every head,
so for the default model (9 query heads, 3 KV heads, 64 dims) it loads 6 values of kmin
and 6 of kmax, and one warp sum per query head adds the dims. The head count, KV head
count and head_dim are compiled in (`make_block_scores_kernel`): the loops unroll, every
load is issued before the first sum needs it, and the nine sums interleave; with the
shapes read at run time instead, each head's loads would wait for the last head's sum.
The host path and a replayed decode step (kv/step_blocks.py: StepBlocks) launch this same
kernel, so their scores are the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

# the shapes compiled in (make_block_scores_kernel): the step attention's head_dims and
# query heads per KV head, so a model the step takes is one QSA can score
from strata_nb.kernels.attention.attention_step import HEAD_DIMS, MAX_GROUP
from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.geometry import SCORE_WARPS
from strata_nb.gpu.reduce import NEG_INF, WARP, warp_sum

MAX_KV = 8  # KV heads


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
def make_block_scores_kernel(G, KV, D):
    """The kernel for G query heads per KV head, KV heads and head_dim D, all compiled in."""
    PER_LANE = D // WARP

    @cuda.jit
    def block_scores_kernel(q, kmin, kmax, scores):  # shapes as block_scores_ref
        # A warp per (query, block): blocks blockIdx.x * SCORE_WARPS .. on, query blockIdx.y;
        # lane l takes dims l, l + 32, ... Past the last block a warp scores the last one
        # again: every warp sums (gpu/reduce.py), only the real ones store.
        i, lane = cuda.blockIdx.y, cuda.threadIdx.x % WARP
        n_blocks = kmin.shape[0]
        b = cuda.blockIdx.x * SCORE_WARPS + cuda.threadIdx.x // WARP
        c = min(b, n_blocks - 1)
        best = NEG_INF
        for g in range(KV):
            for h in range(g * G, (g + 1) * G):
                bound = float32(0.0)
                for j in range(PER_LANE):
                    d = lane + j * WARP
                    x = q[i, h, d]
                    bound += max(x * kmin[c, g, d], x * kmax[c, g, d])
                best = max(best, warp_sum(bound))
        if lane == 0 and b < n_blocks:
            scores[i, b] = best
    return block_scores_kernel
# --8<-- [end:block_scores_kernel]


# Every (G, KV heads, head_dim) the launcher takes, made at import (each compiles on its
# first launch).
BLOCK_SCORES_KERNELS = {(g, kv, d): make_block_scores_kernel(g, kv, d)
                        for g in range(1, MAX_GROUP + 1) for kv in range(1, MAX_KV + 1) for d in HEAD_DIMS}


def block_scores(q, kmin, kmax, scores):
    """Like block_scores_ref (scores agree within float32 summation order: atol 1e-4 * scale)."""
    expect("q", q, np.float32, (None, None, None))
    expect("kmin", kmin, np.float32, (None, None, q.shape[2]))
    expect("kmax", kmax, np.float32, kmin.shape)
    expect("scores", scores, np.float32, (q.shape[0], kmin.shape[0]))
    n_heads, n_kv, hd = q.shape[1], kmin.shape[1], kmin.shape[2]
    key = (n_heads // max(1, n_kv), n_kv, hd)
    assert n_kv > 0 and n_heads % n_kv == 0 and key in BLOCK_SCORES_KERNELS, (
        f"no QSA scores for {n_heads} query heads, {n_kv} KV heads of {hd} dims "
        f"(built: <= {MAX_GROUP} query heads per KV head, <= {MAX_KV} KV heads, head_dim in {HEAD_DIMS})")
    kernel = BLOCK_SCORES_KERNELS[key]
    with DeviceArgs() as dev:
        kernel[((kmin.shape[0] + SCORE_WARPS - 1) // SCORE_WARPS, q.shape[0]), SCORE_WARPS * WARP, stream()](
            dev.read(q), dev.read(kmin), dev.read(kmax), dev.write(scores))
