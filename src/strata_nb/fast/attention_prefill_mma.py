"""Plain twin: kernels/attention/attention.py attention_kernel. Attention for a prompt
chunk on tensor cores: the prompt kernel of attention_prefill.py (read it first) with
its two products, the scores and the V sums, as warp-wide matrix products
(fast/tensor_core.py) instead of each thread's fused multiply-adds.

What stays: one thread block per (tile of queries, KV head, split), the same rows (the G
query heads of the KV head for each query of the tile), the same rounds of 4 selected
blocks (64 cells) unpacked into shared memory by the same code (make_round_loader), the
same online softmax, and the same (max, sum, weighted V sum) per split for the same
combine kernel. A row's result depends only on that row, as there: rows_alone holds.

What changes is who computes what. The block's 4 warps own 16 rows each (64 rows: 21
queries x 3 heads for the default model), and a warp computes its 16 rows whole, as tiles
of 16 x 8 (fast/tensor_core.py's fragments; g = lane // 4, t = lane % 4):

    q        each lane keeps its rows' q values as A fragments, in registers, for the whole
             kernel: rows g and g + 8 of the warp, dims t and t + 4 of every 8 (D / 2 floats)
    scores   S (16 x 64 cells) = q K^T: 8 tiles of 8 cells, each a sum over D / 8 products
             (B: K[cell, dim] from the shared K tile); lane holds cells 2t, 2t + 1 of each
             tile, for rows g and g + 8
    softmax  each row's max over its 4 lanes (quad_max: two shuffles, no shared memory),
             the weights P = exp(S - m) written over the K tile, for the V sums to read back
             in A's places (the C and A fragments of TF32 products do not line up)
    V sums   O (16 x D) += P V: D / 8 tiles, each a sum over 8 products of 8 cells

The tiles in shared memory are padded so that a fragment's 32 loads hit 32 banks: rows of
K (and of P) 4 floats longer (bank 4g + t), rows of V 8 longer (bank 8t + g).

Precision: each product is three TF32 products (tensor_core.mma_f32), float32's accuracy,
so the kernel meets attention.py's tolerance as the plain one does; the bits differ from
the plain kernel's (other sums in another order), so a process uses one or the other.
head_dim 64 (MMA_HEAD_DIMS, the default model's); others run the plain kernel.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint64

from strata_nb.fast.attention_prefill import make_round_loader, tile_cells
from strata_nb.fast import tensor_core
from strata_nb.gpu.geometry import PROMPT_MMA_WARPS
from strata_nb.gpu.reduce import WARP, quad_max, quad_sum
from strata_nb.fast.tensor_core import TILE_K, TILE_M, TILE_N, mma_f32
from strata_nb.kernels.attention.attention import NEG_INF
from strata_nb.kernels.kv.kv_readers import READERS, SIDES
from strata_nb.kv_layout import BLOCK

MMA_HEAD_DIMS = (64,)  # head_dims built (and tested): the default model's
MMA_WARPS = PROMPT_MMA_WARPS  # warps a thread block, 16 rows each
MMA_THREADS = MMA_WARPS * WARP
MMA_ROWS = MMA_WARPS * TILE_M  # rows of a tile: (query, head) pairs
COLUMN_HALVES = 2 * 4  # a round's columns, by parity (as attention_prefill.py's)
QUERY_HALVES = 2 * MMA_ROWS
K_PAD, V_PAD = 4, 8  # floats added to each row of the K (and P) tile and of the V tile
U2, U4 = uint64(2), uint64(4)

def usable(head_dim: int) -> str:
    """'' when this kernel can run prompt attention of head_dim here, else why not."""
    if head_dim not in MMA_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {MMA_HEAD_DIMS}"
    return tensor_core.available()


def most_queries(group: int) -> int:
    """Queries a thread block takes, group query heads each."""
    return MMA_ROWS // group


# --8<-- [start:attention_mma_kernel]
def make_attention_mma_kernel(read_k, read_v, D):
    """The tensor-core prompt kernel for one format and head_dim D (MMA_HEAD_DIMS)."""
    CELLS = tile_cells(D)  # 64 cells a round
    COLS = CELLS // BLOCK
    KD, NC = D // TILE_K, CELLS // TILE_N  # a round's scores: KD products for each of NC tiles
    KC, ND = CELLS // TILE_K, D // TILE_N  # its V sums: KC products for each of ND tiles
    KP_SHAPE = (max(CELLS, MMA_ROWS), max(D, CELLS) + K_PAD)  # K tile kp[c, j], then P[r, c]
    V_SHAPE = (CELLS, D + V_PAD)
    open_round, unpack = make_round_loader(read_k, read_v, D, COLS, MMA_THREADS)

    @cuda.jit(cache=True)
    def attention_mma_kernel(q, q_pos, blocks, page_table, scale, per_split, tile,
                             pool_ka, pool_kb, pool_va, pool_vb, host_ka, host_kb, host_va, host_vb,
                             part_m, part_l, part_acc):
        # The arguments and the grid are attention_kernel's (attention_prefill.py). Shared
        # memory is indexed with unsigned integers, as there: no negative-index wraparound.
        q0, kv_h, split = cuda.blockIdx.x * tile, cuda.blockIdx.y, cuda.blockIdx.z
        t = cuda.threadIdx.x
        lane = t % WARP
        g, tq = uint64(lane // 4), uint64(lane % 4)  # the lane's group and place in it: its fragments
        G = q.shape[1] // pool_ka.shape[1]
        n_tile = min(tile, q.shape[0] - q0)
        rows = n_tile * G
        kp = cuda.shared.array(KP_SHAPE, float32)  # K tile kp[c, j], then the weights P[r, c]
        v_s = cuda.shared.array(V_SHAPE, float32)  # V tile v_s[c, d]
        col_row = cuda.shared.array(COLUMN_HALVES, int32)  # as attention_kernel's
        col_host = cuda.shared.array(COLUMN_HALVES, int32)
        col_start = cuda.shared.array(COLUMN_HALVES, int32)
        chosen = cuda.shared.array(QUERY_HALVES, int32)
        column = cuda.local.array(BLOCK, float32)
        s = cuda.local.array((NC, 4), float32)  # the round's scores: C fragments, 8 cells each
        o = cuda.local.array((ND, 4), float32)  # the weighted V sums: C fragments, 8 dims each
        row = cuda.local.array(2, uint64)  # the lane's rows: g and g + 8 of its warp's 16 (h = 0, 1)
        qrow = cuda.local.array(2, uint64)  # where their q is: query
        qhead = cuda.local.array(2, uint64)  # and head (row 0's for rows past the tile: masked)
        qi = cuda.local.array(2, int32)  # their queries within the tile
        pos = cuda.local.array(2, int32)  # their positions, -1 = no row
        reach = cuda.local.array((2, 4), int32)  # the last cell (0..15) a row sees of each column, -1 = none
        m = cuda.local.array(2, float32)  # the rows' running maxes
        part = cuda.local.array(2, float32)  # the lane's part of their sums
        top = cuda.local.array(2, float32)
        rescale = cuda.local.array(2, float32)

        for h in range(2):
            r = (t // WARP) * TILE_M + int32(g) + 8 * h
            qi[h] = r // G
            pos[h] = q_pos[q0 + qi[h]] if r < rows else -1
            row[h] = uint64(r)
            qrow[h] = uint64(q0 + qi[h]) if pos[h] >= 0 else uint64(q0)
            qhead[h] = uint64(kv_h * G + r % G) if pos[h] >= 0 else uint64(kv_h * G)
            m[h], part[h] = NEG_INF, float32(0.0)
        for n in range(ND):
            for i in range(4):
                o[n, i] = float32(0.0)
        last = -1
        for i in range(q0, q0 + n_tile):
            last = max(last, q_pos[i])

        first = split * per_split
        end = min(first + per_split, blocks.shape[1])
        for s0 in range(first, end, COLS):
            half = ((s0 - first) // COLS) % 2
            cb, qb = half * 4, half * MMA_ROWS
            if not open_round(t, q0, n_tile, s0, end, last, blocks, page_table, col_row, col_host, col_start,
                              chosen, cb, qb):
                continue
            unpack(t, cb, kv_h, last, col_row, col_host, col_start, pool_ka, pool_kb, pool_va, pool_vb,
                   host_ka, host_kb, host_va, host_vb, kp, v_s, column)
            for h in range(2):  # which cells of each column the lane's rows see
                for cc in range(COLS):
                    seen = pos[h] >= 0 and col_row[cb + cc] >= 0 and (chosen[qb + qi[h]] >> cc) & 1 == 1
                    reach[h, cc] = min(pos[h] - col_start[cb + cc], BLOCK - 1) if seen else -1
            cuda.syncthreads()

            # Scores: tile n is cells 8n .. 8n + 7. A is q (a0..a3: rows g, g + 8 at dims t,
            # then t + 4, of these 8 dims), B is K^T (b0 = K[8n + g, t], b1 = K[8n + g, t + 4]).
            for n in range(NC):
                for i in range(4):
                    s[n, i] = float32(0.0)
            for k in range(KD):
                j = uint64(k * TILE_K) + tq
                a0, a1 = q[qrow[0], qhead[0], j], q[qrow[1], qhead[1], j]
                a2, a3 = q[qrow[0], qhead[0], j + U4], q[qrow[1], qhead[1], j + U4]
                for n in range(NC):
                    c = uint64(n * TILE_N) + g
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma_f32(
                        a0, a1, a2, a3, kp[c, j], kp[c, j + U4], s[n, 0], s[n, 1], s[n, 2], s[n, 3])
            # Mask and scale. The lane holds cells 8n + 2t + e (e = 0, 1) of rows g (i = e)
            # and g + 8 (i = 2 + e): cell 8 (n % 2) + 2t + e of column n // 2.
            for h in range(2):
                top[h] = NEG_INF
            for n in range(NC):
                for i in range(4):
                    h = i // 2
                    if (n % 2) * 8 + 2 * int32(tq) + i % 2 <= reach[h, n // 2]:
                        s[n, i] *= scale
                    else:
                        s[n, i] = NEG_INF
                    top[h] = max(top[h], s[n, i])
            for h in range(2):
                top[h] = quad_max(top[h])  # the row's max over its 4 lanes
            cuda.syncthreads()  # every warp is done with the K tile

            # Online softmax; the weights go where the K tile was, P[row, cell]
            for h in range(2):
                m_new = max(m[h], top[h])
                rescale[h] = math.exp(m[h] - m_new) if m_new > NEG_INF else float32(1.0)
                part[h] *= rescale[h]
                m[h] = m_new
            for n in range(NC):
                for i in range(4):
                    h = i // 2
                    p = math.exp(s[n, i] - m[h]) if m[h] > NEG_INF else float32(0.0)  # masked: exp(-inf) = 0
                    kp[row[h], uint64(n * TILE_N + i % 2) + U2 * tq] = p
                    part[h] += p
            for n in range(ND):
                for i in range(4):
                    o[n, i] *= rescale[i // 2]
            cuda.syncthreads()  # every weight written

            # V sums: tile n is dims 8n .. 8n + 7. A is P (a0 = P[g, t] of these 8 cells),
            # B is V (b0 = V[8k + t, 8n + g], b1 = V[8k + t + 4, 8n + g]).
            for k in range(KC):
                c = uint64(k * TILE_K) + tq
                a0, a1, a2, a3 = kp[row[0], c], kp[row[1], c], kp[row[0], c + U4], kp[row[1], c + U4]
                for n in range(ND):
                    d = uint64(n * TILE_N) + g
                    o[n, 0], o[n, 1], o[n, 2], o[n, 3] = mma_f32(
                        a0, a1, a2, a3, v_s[c, d], v_s[c + U4, d], o[n, 0], o[n, 1], o[n, 2], o[n, 3])
            cuda.syncthreads()  # done with the tiles before the next round refills them

        for h in range(2):
            total = quad_sum(part[h])  # the row's sum over its 4 lanes
            if pos[h] >= 0:
                if m[h] > NEG_INF:  # a row that saw no cell here writes no sums: the combine skips it
                    for n in range(ND):
                        for e in range(2):
                            part_acc[qrow[h], qhead[h], split, uint64(n * TILE_N + e) + U2 * tq] = o[n, 2 * h + e]
                if tq == 0:
                    part_m[qrow[h], qhead[h], split] = m[h]
                    part_l[qrow[h], qhead[h], split] = total

    return attention_mma_kernel
# --8<-- [end:attention_mma_kernel]


MMA_KERNELS = {(fmt, d): make_attention_mma_kernel(READERS[k], READERS[v], d)
               for fmt, (k, v) in SIDES.items() for d in MMA_HEAD_DIMS}
