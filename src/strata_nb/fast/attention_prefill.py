"""Plain twin: kernels/attention/attention.py attention_kernel. Attention for a prompt
chunk, a tile of queries per thread block: each selected block is unpacked once for all
the tile's rows, and the scores and V sums are register-tiled matrix products; a combine
kernel merges the splits. fast/attention.py's `attention()` checks the arrays and picks
this, the tensor-core tiles (attention_prefill_mma.py) or the step kernel
(attention_step.py).

Index legend as attention.py: Q queries, H query heads, G = H // n_kv query heads per KV
head, D head_dim, S selected blocks per query.

One thread block per (tile of queries, KV head, split), a split being `per_split`
consecutive columns of the selection. The block's rows are the G query heads of its KV
head for every query of its tile (16 queries x 3 heads for the default model). A
chunk's queries all read "every block up to my position", so their columns agree and
each block is unpacked once for all the tile's rows; per round of 4 selected blocks the
scores and the V sums are two small matrix products, each a register tile, folded into
an online softmax. Each split writes its (max, sum, weighted V sum); the combine kernel
rescales them to the largest max and adds them up.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint64

from strata_nb.fast.attention_step import HEAD_DIMS, MAX_HEAD_DIM
from strata_nb.gpu.geometry import (PROMPT_ALONE_BLOCKS_PER_SPLIT, PROMPT_ALONE_COMBINE_GROUPS,
                                    PROMPT_BLOCKS_PER_SPLIT, PROMPT_ROW_GROUPS, PROMPT_TILE_ROWS)
from strata_nb.gpu.launch import device_empty, stream
from strata_nb.kernels.attention.attention import NEG_INF
from strata_nb.kernels.kv.hadamard import hadamard
from strata_nb.kernels.kv.kv_readers import READERS, SIDES
from strata_nb.kv_layout import BLOCK

# The prompt kernel. A thread block's rows are (query, head) pairs sharing one KV head:
# 16 queries x 3 heads for the default model, at most MAX_TILE_ROWS, and their q values
# fit TILE_VALUES floats. Its 128 threads are 8 row groups x 16 column groups: thread
# (ry, cx) computes rows ry, ry + 8, ... (6 of them) against cells (or output dims) cx,
# cx + 16, ... Under the simulator every thread is a Python thread, and every row of the
# tile is computed, used or not: tiles of 12 rows there, 2 row groups of 6.
MAX_TILE_ROWS = PROMPT_TILE_ROWS
TILE_VALUES = MAX_TILE_ROWS * 64
COL_GROUPS = 16
ROW_GROUPS = PROMPT_ROW_GROUPS
THREADS = ROW_GROUPS * COL_GROUPS
MAX_TILE_QUERIES = MAX_TILE_ROWS  # one head per KV head: a row per query
MAX_TILE_COLUMNS = 4  # selected blocks per round: 64 cells
COLUMN_HALVES, QUERY_HALVES = 2 * MAX_TILE_COLUMNS, 2 * MAX_TILE_QUERIES  # a round's columns, by parity
# Selected blocks per thread block of the prompt kernel, at least (4 = one round); the
# simulator's splits cover up to 64, and tests pass per_split to exercise many splits.
BLOCKS_PER_SPLIT = PROMPT_BLOCKS_PER_SPLIT
# Selected blocks per split when each query's output must not depend on its chunk
# (attention_prompt's rows_alone): fixed, so it cannot follow the chunk's size
ALONE_BLOCKS_PER_SPLIT = PROMPT_ALONE_BLOCKS_PER_SPLIT
# A prompt chunk's splits: about this many thread blocks in all (a few waves of the GPU),
# so a 2,048-query chunk does not keep (query, head, split) partial sums for 4-block splits
PROMPT_THREAD_BLOCKS = 2048
MAX_COMBINE_GROUPS = 16  # thread rows of the combine kernel, each summing every 16th split;
# under the simulator every thread is a Python thread: one row there (tests pass 4 to cover it)
# When rows stand alone the combine has a fixed number of thread rows, whatever the chunk's
# splits (the order it adds them in must not follow the chunk): a few, as most of a row's
# fixed splits lie past its position and add nothing, and a block of 16 x 64 threads for
# every (query, head) of a long chunk keeps the GPU busy with idle threads
ALONE_COMBINE_GROUPS = PROMPT_ALONE_COMBINE_GROUPS


def tile_cells(head_dim: int) -> int:
    """Cells per round of the prompt kernel: 64, or 32 for head_dim 128 (the tiles'
    shared memory holds 64 x 65 and 64 x 64 floats)."""
    return 64 if head_dim <= 64 else 32


# --8<-- [start:round_loader]
def make_round_loader(read_k, read_v, D, COLS, THREADS):
    """The steps that start a round in both prompt kernels (this file's and
    attention_prefill_mma.py's), for one format, head_dim D, COLS selected blocks a round
    and THREADS threads a block: open_round (skip the round when it reads nothing), then
    unpack and a barrier. Every thread of the block calls each."""

    @cuda.jit(device=True)
    def open_round(t, q0, n_tile, s0, end, last, blocks, page_table, col_row, col_host, col_start, chosen, cb, qb):
        """The round's columns s0 .. s0 + COLS - 1 of the selection, into the shared lists
        from cb: which slot (or block of the host copy) each reads, -1 = none; and from qb,
        which of them each query of the tile selected (bit cc of chosen). Then a barrier,
        and whether the round reads any column: the same answer in every thread, so a
        thread that skips the round skips no barrier alone."""
        shared_row = 1 if blocks.shape[0] == 1 else 0  # one selection for every query
        for cc in range(t, COLS, THREADS):
            b = -1  # the tile's block in this column: its queries agree (the launcher checked)
            if s0 + cc < end:
                for i in range(q0, q0 + n_tile):
                    b = max(b, blocks[i if shared_row == 0 else 0, s0 + cc])
            seen = b >= 0 and b * BLOCK <= last  # padding, or wholly after the tile: skipped
            slot = page_table[b] if seen else -1
            col_row[cb + cc] = (slot if slot >= 0 else b) if seen else -1
            col_host[cb + cc] = 1 if slot < 0 else 0
            col_start[cb + cc] = b * BLOCK
        for qi in range(t, n_tile, THREADS):
            bits = 0
            for cc in range(COLS):
                if s0 + cc < end and blocks[q0 + qi if shared_row == 0 else 0, s0 + cc] >= 0:
                    bits |= 1 << cc
            chosen[qb + qi] = bits
        cuda.syncthreads()
        seen = False
        for cc in range(COLS):
            seen = seen or col_row[cb + cc] >= 0
        return seen

    @cuda.jit(device=True)
    def unpack(t, cb, kv_h, last, col_row, col_host, col_start, pool_ka, pool_kb, pool_va, pool_vb,
               host_ka, host_kb, host_va, host_vb, kp, v_s, column):
        """The round's K and V rows, dequantized, into kp[c, j] and v_s[c, d]: thread u of a
        column reads value u of the block's 16 K (or V) rows. Cells no query of the tile
        sees are zeros, so a weight of 0 never meets a NaN."""
        for e in range(t, COLS * 2 * D, THREADS):
            cc, u = e // (2 * D), e % (2 * D)
            r = col_row[cb + cc]
            c0 = cc * BLOCK
            if u < D:
                if r >= 0:
                    if col_host[cb + cc] == 1:
                        read_k(host_ka, host_kb, r, kv_h, u, column)
                    else:
                        read_k(pool_ka, pool_kb, r, kv_h, u, column)
                for c in range(BLOCK):  # unwritten cells may hold NaN: no query sees them
                    seen = r >= 0 and col_start[cb + cc] + c <= last
                    kp[c0 + c, u] = column[c] if seen else float32(0.0)
            else:
                if r >= 0:
                    if col_host[cb + cc] == 1:
                        read_v(host_va, host_vb, r, kv_h, u - D, column)
                    else:
                        read_v(pool_va, pool_vb, r, kv_h, u - D, column)
                for c in range(BLOCK):
                    seen = r >= 0 and col_start[cb + cc] + c <= last
                    v_s[c0 + c, u - D] = column[c] if seen else float32(0.0)

    return open_round, unpack
# --8<-- [end:round_loader]


# --8<-- [start:attention_kernel]
def make_attention_kernel(read_k, read_v, D):
    """The prompt kernel for one format (how it reads a column of K and of V:
    kv_readers.py) and head_dim D, compiled in so each thread's register tiles have fixed
    sizes and their loops unroll."""
    CELLS = tile_cells(D)  # cells per round: 64 for D <= 64
    COLS = CELLS // BLOCK  # selected blocks per round
    CPT = CELLS // COL_GROUPS  # cells per thread in the scores
    DPT = D // COL_GROUPS  # output dims per thread in the V sums
    Q_ROWS = min(MAX_TILE_ROWS, TILE_VALUES // D)  # rows a tile has at most (tile_for)
    RM = Q_ROWS // ROW_GROUPS  # rows per thread
    # The shared tiles, shaped per D, under the 48 KiB a block may have statically (D = 64
    # on a GPU): q (12 KiB), the K tile with rows padded by one value (16.3 KiB), the V
    # tile (16 KiB), the rows' partial maxes and sums (3 KiB). The K tile's array also holds
    # the round's weights (Q_ROWS x CELLS) once the scores are done with it.
    Q_SHAPE, KP_SHAPE, V_SHAPE = (D, Q_ROWS), (max(CELLS, Q_ROWS), max(D, CELLS) + 1), (CELLS, D)
    uD, uCELLS, uRG, uCG = uint64(D), uint64(CELLS), uint64(ROW_GROUPS), uint64(COL_GROUPS)
    B_REGS = max(CPT, DPT)  # K values of the scores, then V values of the sums
    open_round, unpack = make_round_loader(read_k, read_v, D, COLS, THREADS)

    @cuda.jit(cache=True)
    def attention_kernel(q,           # (Q, H, D) float32
                         q_pos,       # (Q,) int32
                         blocks,      # (Q, S) int32, -1 = padding; or (1, S), every query's
                         page_table,  # (n_logical_blocks,) int32
                         scale,       # float32: 1 / sqrt(D)
                         per_split,   # int32: selected blocks per split
                         tile,        # int32: queries per thread block (their columns agree)
                         pool_ka, pool_kb, pool_va, pool_vb,  # K and V of the pool, by slot
                         host_ka, host_kb, host_va, host_vb,  # the same by logical block, or (0, ...)
                         part_m, part_l,  # (Q, H, n_splits) float32, written: each split's max and sum
                         part_acc):   # (Q, H, n_splits, D) float32, written: its weighted V sum
        # One thread block per (tile of queries, KV head, split): a split is `per_split`
        # consecutive columns of the selection, and the block's rows are the G query
        # heads of its KV head for every query of the tile (row r: query q0 + r // G,
        # head kv_h * G + r % G). Thread (ry, cx) owns rows ry + ROW_GROUPS * i. Per
        # round of COLS selected blocks (CELLS cells):
        #   unpack   the K and V rows into shared tiles, dequantized (cells no query of
        #            the tile sees: zeros, so a weight of 0 never meets a NaN)
        #   scores   S = q K^T * scale as a register tile: the thread's rows x cells
        #            cx + 16 jj, RM + CPT shared loads per RM * CPT multiply-adds
        #   softmax  each row's max over its 16 threads' partial maxes (shared), the
        #            weights exp(S - m) written over the K tile, the thread's running
        #            sums rescaled: an online softmax, no score kept past its round
        #   V sums   acc += P V, the same register tiling over dims cx + 16 dd
        # The threads of a row keep their own part of its sum l; they add them at the
        # end. attention_combine_kernel merges the splits.
        q0, kv_h, split = cuda.blockIdx.x * tile, cuda.blockIdx.y, cuda.blockIdx.z
        t = cuda.threadIdx.x
        ry, cx = t // COL_GROUPS, t % COL_GROUPS
        # The two register tiles index shared memory with unsigned integers: Numba then
        # adds no negative-index wraparound to each load, which doubled their instructions.
        u_ry, u_cx = uint64(ry), uint64(cx)
        G = q.shape[1] // pool_ka.shape[1]  # consecutive query heads share a KV head
        n_tile = min(tile, q.shape[0] - q0)
        rows = n_tile * G
        q_s = cuda.shared.array(Q_SHAPE, float32)  # q_s[j, r]: a warp's two rows side by side
        kp = cuda.shared.array(KP_SHAPE, float32)  # K tile kp[c, j] (rows padded), then weights kp[r, c]
        v_s = cuda.shared.array(V_SHAPE, float32)  # v_s[c, d]
        red = cuda.shared.array((MAX_TILE_ROWS, COL_GROUPS), float32)  # red[r, cx]: row maxes, then sums
        # Each round's columns, in two halves by round parity: a thread writing round k + 1's
        # cannot overtake one still reading round k's (a barrier lies between)
        col_row = cuda.shared.array(COLUMN_HALVES, int32)  # slot (or block) to read, -1 = none
        col_host = cuda.shared.array(COLUMN_HALVES, int32)  # 1 = from the host copy
        col_start = cuda.shared.array(COLUMN_HALVES, int32)  # first cell's position
        chosen = cuda.shared.array(QUERY_HALVES, int32)  # bit cc: the query selected column cc
        column = cuda.local.array(BLOCK, float32)
        s_reg = cuda.local.array((RM, CPT), float32)
        acc = cuda.local.array((RM, DPT), float32)
        a_reg = cuda.local.array(RM, float32)
        b_reg = cuda.local.array(B_REGS, float32)
        m_r = cuda.local.array(RM, float32)
        l_r = cuda.local.array(RM, float32)
        pos_r = cuda.local.array(RM, int32)  # the row's query position, -1 = no row
        qi_r = cuda.local.array(RM, int32)  # the row's query within the tile (r // G: worked out
                                            # once, G is known only at run time, and a runtime
                                            # division is a long routine on a GPU)

        for e in range(t, Q_ROWS * D, THREADS):  # rows past the tile's: zeros
            r, j = e // D, e % D
            q_s[j, r] = q[q0 + r // G, kv_h * G + r % G, j] if r < rows else float32(0.0)
        last = -1  # the tile's last visible position
        for i in range(q0, q0 + n_tile):
            last = max(last, q_pos[i])
        for i in range(RM):
            r = ry + ROW_GROUPS * i
            qi_r[i] = r // G
            pos_r[i] = q_pos[q0 + qi_r[i]] if r < rows else -1
            m_r[i], l_r[i] = NEG_INF, float32(0.0)
            for dd in range(DPT):
                acc[i, dd] = float32(0.0)

        first = split * per_split
        end = min(first + per_split, blocks.shape[1])
        for s0 in range(first, end, COLS):
            half = ((s0 - first) // COLS) % 2
            cb, qb = half * MAX_TILE_COLUMNS, half * MAX_TILE_QUERIES
            if not open_round(t, q0, n_tile, s0, end, last, blocks, page_table, col_row, col_host, col_start,
                              chosen, cb, qb):
                continue

            unpack(t, cb, kv_h, last, col_row, col_host, col_start, pool_ka, pool_kb, pool_va, pool_vb,
                   host_ka, host_kb, host_va, host_vb, kp, v_s, column)
            cuda.syncthreads()

            # Scores, a register tile: RM q values and CPT K values per j, RM * CPT products.
            for i in range(RM):
                for jj in range(CPT):
                    s_reg[i, jj] = float32(0.0)
            for j in range(uD):
                for i in range(RM):
                    a_reg[i] = q_s[j, u_ry + uRG * uint64(i)]
                for jj in range(CPT):
                    b_reg[jj] = kp[u_cx + uCG * uint64(jj), j]
                for i in range(RM):
                    for jj in range(CPT):
                        s_reg[i, jj] += a_reg[i] * b_reg[jj]
            for i in range(RM):
                r = ry + ROW_GROUPS * i
                qi = qi_r[i]
                top = NEG_INF
                for jj in range(CPT):
                    c = cx + COL_GROUPS * jj
                    cc = c // BLOCK
                    if (pos_r[i] >= 0 and col_row[cb + cc] >= 0 and (chosen[qb + qi] >> cc) & 1 == 1
                            and col_start[cb + cc] + c % BLOCK <= pos_r[i]):
                        s_reg[i, jj] *= scale
                    else:
                        s_reg[i, jj] = NEG_INF
                    top = max(top, s_reg[i, jj])
                red[r, cx] = top
            cuda.syncthreads()  # the row maxes are in, and every thread is done with the K tile

            # Online softmax: the row's new max, the old sums rescaled, the weights written
            # where the K tile was.
            for i in range(RM):
                r = ry + ROW_GROUPS * i
                m_new = m_r[i]
                for x in range(COL_GROUPS):
                    m_new = max(m_new, red[r, x])
                if m_new > NEG_INF:
                    rescale = math.exp(m_r[i] - m_new)  # exp(-inf) = 0 when the row saw nothing before
                    total = l_r[i] * rescale
                    for jj in range(CPT):
                        p = math.exp(s_reg[i, jj] - m_new)  # a masked cell: exp(-inf) = 0
                        kp[r, cx + COL_GROUPS * jj] = p
                        total += p
                    l_r[i], m_r[i] = total, m_new
                    for dd in range(DPT):
                        acc[i, dd] *= rescale
                else:  # the row has seen no cell yet
                    for jj in range(CPT):
                        kp[r, cx + COL_GROUPS * jj] = float32(0.0)
            cuda.syncthreads()  # every weight written

            # V sums, a register tile: RM weights and DPT V values per cell.
            for c in range(uCELLS):
                for i in range(RM):
                    a_reg[i] = kp[u_ry + uRG * uint64(i), c]
                for dd in range(DPT):
                    b_reg[dd] = v_s[c, u_cx + uCG * uint64(dd)]
                for i in range(RM):
                    for dd in range(DPT):
                        acc[i, dd] += a_reg[i] * b_reg[dd]
            cuda.syncthreads()  # done with the tiles before the next round refills them

        # Each row's sum from its 16 threads' parts, added in thread order.
        for i in range(RM):
            red[ry + ROW_GROUPS * i, cx] = l_r[i]
        cuda.syncthreads()
        for i in range(RM):
            r = ry + ROW_GROUPS * i
            if r < rows:
                qi, h = q0 + r // G, kv_h * G + r % G
                if m_r[i] > NEG_INF:  # a row that saw no cell here writes no sums: the combine skips it
                    for dd in range(DPT):
                        part_acc[qi, h, split, cx + COL_GROUPS * dd] = acc[i, dd]
                if cx == 0:
                    total = float32(0.0)
                    for x in range(COL_GROUPS):
                        total += red[r, x]
                    part_m[qi, h, split] = m_r[i]
                    part_l[qi, h, split] = total

    return attention_kernel


ATTENTION_KERNELS = {(fmt, d): make_attention_kernel(READERS[k], READERS[v], d)
                     for fmt, (k, v) in SIDES.items() for d in HEAD_DIMS}


@cuda.jit(cache=True)
def attention_combine_kernel(part_m, part_l, part_acc,  # as attention_kernel wrote them
                             out):  # (Q, H, D) float32, written
    # One thread block per (query, head): thread (t, g) owns dimension t and every
    # groups-th split from g (groups = blockDim.y). Rescale each split's sums to the largest max, add
    # them up, divide. A split that saw no cell has m = -inf and l = 0 and wrote no V
    # sums: it is skipped, where its weight exp(-inf) = 0 would add exact zeros (the same
    # bits; a prompt row's later splits, and a replayed chunk's whole row of blocks past
    # its position, are such splits). The groups' partial sums are added in group order,
    # so the result does not depend on timing.
    qi, h = cuda.blockIdx.x, cuda.blockIdx.y
    t, g = cuda.threadIdx.x, cuda.threadIdx.y
    n_splits, groups = part_m.shape[2], cuda.blockDim.y
    group_top = cuda.shared.array(MAX_COMBINE_GROUPS, float32)
    group_l = cuda.shared.array(MAX_COMBINE_GROUPS, float32)
    group_acc = cuda.shared.array((MAX_COMBINE_GROUPS, MAX_HEAD_DIM), float32)
    top = NEG_INF
    for s in range(g, n_splits, groups):
        top = max(top, part_m[qi, h, s])
    if t == 0:
        group_top[g] = top
    cuda.syncthreads()
    for j in range(groups):
        top = max(top, group_top[j])
    l, acc = float32(0.0), float32(0.0)
    if top > NEG_INF:
        for s in range(g, n_splits, groups):
            m_s = part_m[qi, h, s]
            if m_s > NEG_INF:  # the threads of a block agree: no divergence
                w = math.exp(m_s - top)
                l += part_l[qi, h, s] * w
                acc += part_acc[qi, h, s, t] * w
    group_acc[g, t] = acc
    if t == 0:
        group_l[g] = l
    cuda.syncthreads()
    if g == 0:
        l, acc = float32(0.0), float32(0.0)
        for j in range(groups):
            l += group_l[j]
            acc += group_acc[j, t]
        out[qi, h, t] = acc / l if l > 0 else float32(0.0)
# --8<-- [end:attention_kernel]


def most_queries(group: int, head_dim: int) -> int:
    """Queries a thread block of the prompt kernel takes, group query heads each."""
    return min(MAX_TILE_ROWS // group, TILE_VALUES // (group * head_dim))


def tile_for(blocks, group: int, head_dim: int, n_q: int | None = None, most: int | None = None) -> int:
    """Queries per thread block, for n_q queries (default: blocks' rows): as many as the
    kernel's tile holds (most: default this file's kernel's), when every tile's queries
    agree on each column of `blocks` (a block or -1, as all_blocks_upto's rows do; a (1, S)
    selection is every query's); otherwise, or when a per-query `blocks` is in device
    memory, 1."""
    most = most_queries(group, head_dim) if most is None else most
    n_q = blocks.shape[0] if n_q is None else n_q
    if n_q < 2 or most < 2:
        return 1
    tile = min(most, n_q)
    if blocks.shape[0] == 1:  # shared: NumPy or in device memory
        return tile
    if not isinstance(blocks, np.ndarray):
        return 1
    padded = np.full((-(-n_q // tile) * tile, blocks.shape[1]), -1, np.int32)
    padded[:n_q] = blocks
    padded = padded.reshape(-1, tile, blocks.shape[1])
    hi = padded.max(axis=1)
    lo = np.where(padded < 0, np.iinfo(np.int32).max, padded).min(axis=1)
    return tile if bool(np.all((hi < 0) | (lo == hi))) else 1


# --8<-- [start:attention_prompt]
def attention_prompt(fmt, n_kv, args, sides, out, rotate_out: bool, per_split: int | None, combine_groups: int,
                     tile: int, rows_alone: bool = False, kernel=None, threads: int | None = None):
    """Launch the prompt kernel and the combine; attention() (fast/attention.py) has checked
    the arrays and moved them. args: (q, q_pos, blocks, page_table, scale), sides: the eight
    pool and host arrays (kv_readers.py: side_arrays), out: the device output. per_split None = a
    few waves of thread blocks in all, in whole rounds. kernel, threads: another kernel
    of the same arguments and grid to run (attention_prefill_mma.py's), and its block's
    threads; None = this file's.

    rows_alone: each query's output must not depend on the chunk it came in. The splits
    are then ALONE_BLOCKS_PER_SPLIT blocks (or per_split) from block 0, however far the row
    reaches and however many queries share the launch, and the combine always has the
    same thread rows (ALONE_COMBINE_GROUPS); a split or a row with nothing to add is skipped, as adding
    it would add exact zeros. A
    query in a tile beside others reads the columns they see and it does not, each
    masked to a weight of exactly 0, which leaves its sums as they were."""
    q, blocks = args[0], args[2]
    n_q, n_heads, head_dim = q.shape
    assert head_dim in HEAD_DIMS, f"no prompt kernel for head_dim {head_dim} (built: {HEAD_DIMS})"
    cols = tile_cells(head_dim) // BLOCK
    if rows_alone:
        per_split = ALONE_BLOCKS_PER_SPLIT if per_split is None else per_split
    elif per_split is None:  # long prompt chunks have tiles enough to fill the GPU: fewer, longer splits
        want = max(1, PROMPT_THREAD_BLOCKS // (-(-n_q // tile) * n_kv))
        per_split = max(BLOCKS_PER_SPLIT, -(-blocks.shape[1] // want))
        per_split = -(-per_split // cols) * cols  # whole rounds
    n_splits = max(1, -(-blocks.shape[1] // per_split))
    # at most 1024 threads a block, and (unless rows_alone) no more thread rows than splits
    combine_groups = min(combine_groups, 1024 // head_dim, ALONE_COMBINE_GROUPS if rows_alone else n_splits)
    assert 1 <= combine_groups <= MAX_COMBINE_GROUPS, f"combine_groups {combine_groups} not in 1..{MAX_COMBINE_GROUPS}"
    part_m = device_empty((n_q, n_heads, n_splits), np.float32)
    part_l = device_empty((n_q, n_heads, n_splits), np.float32)
    part_acc = device_empty((n_q, n_heads, n_splits, head_dim), np.float32)
    if kernel is None:
        kernel, threads = ATTENTION_KERNELS[fmt, head_dim], THREADS
    kernel[(-(-n_q // tile), n_kv, n_splits), threads, stream()](
        *args, np.int32(per_split), np.int32(tile), *sides, part_m, part_l, part_acc)
    mixed = device_empty(out.shape, np.float32) if rotate_out else out
    attention_combine_kernel[(n_q, n_heads), (head_dim, combine_groups), stream()](
        part_m, part_l, part_acc, mixed)
    if rotate_out:
        hadamard(mixed, out=out)
# --8<-- [end:attention_prompt]
