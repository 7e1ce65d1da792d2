"""QSA block scores (strata-nb's own): how much a block could matter to a query.

A block's score is the largest q . k over its cells and the query's heads, each head
taking the keys of its GQA group's KV head. The keys are the key sketch's
(kernels/kv/key_sketch.py): every cell's K in 4-bit q4_0, kept in VRAM for the whole
context, so scoring reads no K/V from the host copy. A 4-bit key is close enough to rank
the blocks as the real keys would: the block a retrieval head attends to most is the one
with its best-scoring cell (docs/walkthrough/select.md has the probe that measures it).

Only the blocks selection ranks get a score: block 0 and the recent window are always
read, and blocks after the query are not read at all, so their entries are -inf
(`candidates`). A decode step's grid covers every block of the context, because a
replayed launch cannot change shape; the thread block of a block the query does not
rank writes its -inf and stops, so a step early in a long context scores only what it has.

A thread block scores one block for one query, a warp per KV head; lane l takes cell
l % 16 and the q4_0 groups l // 16, l // 16 + 2, ... of that cell's row (both halves of a
64-dim head, one each). A lane holds its group's 32 values of each query head of the KV head's
group in registers, reads the group's 16 code bytes and d once, and sums the products of
q and code (low nibbles and high ones apart: two shorter chains) before taking off 8 x the
sum of q and scaling by d. The two lanes of a cell add their halves (gpu/half_warp.py:
`add_half_warp`, a shuffle), the warp takes the max over cells and heads, and the
warps' maxima meet in shared memory. The head count, KV head count and head_dim are
compiled in (`make_block_scores_kernel`), so the loops unroll and a lane's loads go out
together. The host path and a graph-replayed decode step (kv/step_blocks.py: StepBlocks)
run this kernel's code, so their scores are the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

# the shapes compiled in (make_block_scores_kernel): the step attention's head_dims and
# query heads per KV head, so a model the step takes is one QSA can score
from strata_nb.kernels.kv.quant_q4_0 import D_STRIDE, HALF, dequantize_q4_0_ref
from strata_nb.kernels.step.select_rows import candidates
from strata_nb.gpu.half_warp import add_half_warp
from strata_nb.gpu.launch import DeviceArgs, expect, stream, view_bytes
from strata_nb.gpu.reduce import NEG_INF, WARP, warp_max
from strata_nb.kv_layout import BLOCK, Q4_BYTES, Q4_GROUP

MAX_KV = 8  # KV heads
MAX_GROUP = 8  # query heads per KV head
HEAD_DIMS = (32, 64, 128, 256)  # head_dim is compiled into the kernel: these are built (256: Gemma 3's)


# --8<-- [start:block_scores_ref]
def block_scores_ref(q,              # (n_q, n_heads, hd) float32 (rotated when the format rotates Q)
                     sketch,         # (n_blocks, n_kv, BLOCK, hd // 32 * 18) uint8: the key sketch
                     positions,      # (n_q,) int32: each query's position
                     window_blocks,  # int: the window's blocks (--kv-window // 16)
                     scores):        # (n_q, n_blocks) float32, written: -inf where not a candidate
    n_heads = q.shape[1]
    scores[...] = NEG_INF
    kv_of = np.arange(n_heads) // (n_heads // sketch.shape[1])  # the KV head each query head reads
    for i, pos in enumerate(np.asarray(positions)):  # one query at a time: its sums are a step's
        cand = candidates(int(pos), window_blocks)
        if len(cand):
            keys = dequantize_q4_0_ref(sketch[cand.start:cand.stop])  # (blocks, n_kv, BLOCK, hd)
            dots = np.einsum("hd,bhcd->bhc", q[i], keys[:, kv_of])  # (blocks, heads, cells)
            scores[i, cand.start:cand.stop] = dots.reshape(len(cand), -1).max(axis=-1)
# --8<-- [end:block_scores_ref]


# --8<-- [start:block_scores_kernel]
def make_block_scores_kernel(G, KV, D):
    """The kernel for G query heads per KV head, KV heads and head_dim D, all compiled in."""
    GROUPS = D // Q4_GROUP

    @cuda.jit(cache=True)
    def block_scores_kernel(q, sketch, sketch_d, positions, window_blocks, scores):  # as block_scores_ref; sketch_d: its bytes as float16
        # Thread block (b, i): block b, query i; warp g: KV head g; lane: cell c, groups w0, w0 + 2, ...
        b, i = cuda.blockIdx.x, cuda.blockIdx.y
        t = cuda.threadIdx.x
        # The grid covers every block of the context (a replayed step's launch is fixed); a
        # block the query does not rank is marked and left: its thread block reads nothing else.
        if b == 0 or b > positions[i] // BLOCK - window_blocks:
            if t == 0:
                scores[i, b] = NEG_INF
            return
        g, lane = t // WARP, t % WARP
        c, w0 = lane % BLOCK, lane // BLOCK
        qr = cuda.local.array((G, Q4_GROUP), float32)  # the group's 32 values of each query head: registers
        dot = cuda.local.array(G, float32)  # this lane's half of each query head's q . k
        lo = cuda.local.array(G, float32)  # one group's sums of q x code, before the offset and scale:
        hi = cuda.local.array(G, float32)  # low nibbles and high ones, two shorter chains
        for u in range(G):
            dot[u] = float32(0.0)
        for w in range(w0, GROUPS, 2):  # one q4_0 group: 32 values, byte e holds values e and e + 16
            for u in range(G):
                for e in range(Q4_GROUP):
                    qr[u, e] = q[i, g * G + u, w * Q4_GROUP + e]
                lo[u] = float32(0.0)
                hi[u] = float32(0.0)
            for e in range(HALF):
                byte = sketch[b, g, c, w * Q4_BYTES + 2 + e]
                low, high = float32(byte & 0x0F), float32(byte >> 4)  # codes 0..15: value = (code - 8) * d
                for u in range(G):
                    lo[u] += qr[u, e] * low
                    hi[u] += qr[u, HALF + e] * high
            d = float32(sketch_d[b, g, c, w * D_STRIDE])
            for u in range(G):
                q_sum = float32(0.0)
                for e in range(Q4_GROUP):
                    q_sum += qr[u, e]
                dot[u] += (lo[u] + hi[u] - float32(8.0) * q_sum) * d
        best = NEG_INF
        for u in range(G):
            best = max(best, add_half_warp(dot[u], lane))  # the cell's whole q . k for head u
        best = warp_max(best)  # the KV head's best cell and head
        heads = cuda.shared.array(KV, float32)
        if lane == 0:
            heads[g] = best
        cuda.syncthreads()
        if t == 0:
            for h in range(1, KV):
                best = max(best, heads[h])
            scores[i, b] = best
    return block_scores_kernel
# --8<-- [end:block_scores_kernel]


# Every (G, KV heads, head_dim) the launcher takes, made at import (each compiles on its
# first launch).
BLOCK_SCORES_KERNELS = {(g, kv, d): make_block_scores_kernel(g, kv, d)
                        for g in range(1, MAX_GROUP + 1) for kv in range(1, MAX_KV + 1) for d in HEAD_DIMS}


def block_scores(q, sketch, positions, window_blocks: int, scores):
    """Like block_scores_ref (scores agree within float32 summation order: atol 1e-4 * scale)."""
    expect("q", q, np.float32, (None, None, None))
    n_heads, hd = q.shape[1], q.shape[2]
    expect("sketch", sketch, np.uint8, (None, None, BLOCK, hd // Q4_GROUP * Q4_BYTES))
    expect("positions", positions, np.int32, (q.shape[0],))
    expect("scores", scores, np.float32, (q.shape[0], sketch.shape[0]))
    n_kv = sketch.shape[1]
    key = (n_heads // max(1, n_kv), n_kv, hd)
    assert n_kv > 0 and n_heads % n_kv == 0 and key in BLOCK_SCORES_KERNELS, (
        f"no QSA scores for {n_heads} query heads, {n_kv} KV heads of {hd} dims "
        f"(built: <= {MAX_GROUP} query heads per KV head, <= {MAX_KV} KV heads, head_dim in {HEAD_DIMS})")
    kernel = BLOCK_SCORES_KERNELS[key]
    with DeviceArgs() as dev:
        keys = dev.read(sketch)
        kernel[(sketch.shape[0], q.shape[0]), n_kv * WARP, stream()](
            dev.read(q), keys, view_bytes(keys, np.float16), dev.read(positions), np.int32(window_blocks),
            dev.write(scores))
