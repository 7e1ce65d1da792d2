"""Plain twin: kernels/attention/attention.py attention_kernel. A split of the selection
per thread block, merged in the same launch by the block that finishes last: a long
context fills the GPU, and each K and V row is read once for the G heads that share it.
fast/attention.py's `attention()` checks the arrays, moves them and calls the launcher
here for a decode step or a verify window (one query per thread block).

Index legend as attention.py: Q queries, H query heads, G = H // n_kv query heads per
KV head, D head_dim; a split is `per_split` consecutive columns of the selection, so
C = per_split * 16 cells.

The plain kernel's thread block per (query, head) leaves most of a GPU idle and reads
each K and V row G times. `attention_step_kernel` takes a (query, KV head, split) per
thread block instead, and spreads every stage of the split over the block's threads:

    unpack    the split's K and V, dequantized into shared tiles: 16 values per
              column read, neighbouring threads on neighbouring bytes, each byte once
    scores    one (head, cell) pair per thread: C * G dots at once
    softmax   one warp per head: warp_max, then warp_sum of the exp weights
    V sum     one (head, dim) output per thread, a sum over the C cells

Merging the splits in the same launch. Each thread block writes its record (the G
heads' weighted V sums, max m and sum l), makes it visible to the whole GPU
(threadfence), and takes a ticket from the (query, KV head)'s counter in `arrivals`.
The block that draws the last ticket merges every record in split order, exactly as a
second combine launch would, writes the output and sets the counter back to 0 for the
next launch or graph replay. One (query, KV head)'s records fill whole 128-byte lines
(RECORD_PAD), so the merging block cannot hold another group's line in its L1 from an
earlier read: its loads see what the other blocks wrote.

A lone split. Near an empty context only the first split sees a cell (a replayed step
lists every block of the cache). When the list is ordered (ascending, -1 padding at the
end: every list the engine makes) and its column just after the first split is unseen,
no later column is seen either: the other splits leave after their first barrier, and
the first goes from its V sums straight to the merge's last stage (`write_output`), with
no record, ticket or merge. The merge would have weighed its one record by exp(0) = 1
and added zeros: the same bits.

Two builds of it, by thread blocks an SM. A split's thread block has 256 threads and
about 44 KiB of shared tiles. As written, it compiles to 72 to 80 registers a thread
(ptxas, sm_90), so three thread blocks fit an SM: 396 on a 132-SM GPU, enough for a deep
context's splits in one wave. Built with `launch_bounds=(256, 2)` it may use up to 128
registers, and two fit. With more registers its chains of loads and sums are shorter, so
each thread block finishes sooner. So a launch whose thread blocks that can see a cell fit
two to an SM (`blocks_per_sm`) gets the two-an-SM build; a larger one gets the
three-an-SM build. That is a short context's step, a QSA step, or a step whose list the
decode step keeps narrow (`two_per_sm_columns`, kv/step_blocks.py). Both builds run the
same arithmetic in the same order, so their bits are the same.

With `rotate`, the merging block also applies the Hadamard transform to each head row
(hadamard.py's butterflies, one pair per thread per round, the same additions in the
same order: the same bits as hadamard_ref on the output), which is how a rotated V comes
back without another launch. The plain launcher rotates its output with a second
launch (hadamard).

Tolerance against attention_ref: attention.py's ATOL and RTOL. The arithmetic differs
from the reference only in the order of float32 sums (a 64-term dot per score, the
softmax cell by cell or split by split, the merge) and in exp.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.geometry import MERGE_UNROLL, SIMULATED, STEP_THREADS, multiprocessors
from strata_nb.gpu.launch import device_empty, last_to_arrive, stream, ticket_counters
from strata_nb.gpu.reduce import WARP, warp_max, warp_sum
from strata_nb.kernels.attention.attention import NEG_INF
from strata_nb.kernels.kv.hadamard import N as HADAMARD_N, SCALE as HADAMARD_SCALE
from strata_nb.kernels.kv.kv_readers import READERS, SIDES
from strata_nb.kv_layout import BLOCK

MAX_GROUP = 8  # query heads per KV head the shared arrays hold
HEAD_DIMS = (32, 64, 128)  # head_dim is compiled into the kernel: these are built
MAX_HEAD_DIM = max(HEAD_DIMS)  # the widest head row the fast tier's shared arrays hold
Q_VALUES = MAX_GROUP * MAX_HEAD_DIM  # the G query rows of one KV head
MAX_SPLIT_BLOCKS = 8
MAX_SPLIT_CELLS = MAX_SPLIT_BLOCKS * BLOCK
# The shared K and V tiles of a split, dequantized: 64 cells x 64 dims for the default
# model (K rows padded by one value, so a warp scoring 32 cells reads 32 banks), 33 KiB.
# After the scores the K tile holds the merge's split weights: G * n_splits of them.
K_TILE_VALUES = 64 * 65
V_TILE_VALUES = 64 * 64
# A split of 4 blocks (64 cells) for STEP_THREADS = 256 threads: four threads per cell,
# each scoring a quarter of D for all G heads. 256 threads, not 128, cut each stage's
# chain of work per thread. Under the simulator every thread is a Python thread: one
# warp there.
STEP_BLOCKS_PER_SPLIT = 4
# The (part, head, cell) partial scores, and after them the (lane, head, dim) V sums: at
# most this many, so score_parts and split_lanes use fewer threads for a large G or D.
SCORE_VALUES = MAX_GROUP * 128
RECORD_PAD = 32  # floats after a record's D sums: m, l, then padding to whole 128-byte lines
HADAMARD_ROUNDS = HADAMARD_N.bit_length() - 1  # 6: 64 = 2 ** 6


@cuda.jit(device=True)
def fwht64_rows(rows, n_rows, width, t, n_threads):
    """Transform rows[r, :width] in place for r < n_rows, every 64 values: rows is a 2-D
    shared array, and every thread of the block calls this together (thread t of
    n_threads). hadamard.py's fwht64 rounds with one butterfly per thread per round and a
    barrier between rounds: the same additions in the same order, so the same bits as
    hadamard_ref; the merging block rotates its output with it."""
    for lg in range(HADAMARD_ROUNDS):  # round lg pairs values h = 2**lg apart
        h = 1 << lg
        for p in range(t, n_rows * width // 2, n_threads):
            r, k = p // (width // 2), p % (width // 2)
            # pair (j, j + h) of its run of 2h values: (k // h) * 2h + k % h, in shifts
            # (h is a power of two, and a division by a runtime value is slow on a GPU)
            j = ((k >> lg) << (lg + 1)) | (k & (h - 1))
            a = rows[r, j]
            b = rows[r, j + h]
            rows[r, j] = a + b
            rows[r, j + h] = a - b
        cuda.syncthreads()
    for e in range(t, n_rows * width, n_threads):
        rows[e // width, e % width] *= HADAMARD_SCALE
    cuda.syncthreads()


def split_fits(head_dim: int) -> int:
    """The most selected blocks a split can take: its K and V tiles fit the shared arrays."""
    return min(MAX_SPLIT_BLOCKS, K_TILE_VALUES // (BLOCK * (head_dim + 1)), V_TILE_VALUES // (BLOCK * head_dim))


def record_width(head_dim: int) -> int:
    """Floats per (split, head) record: D sums, m, l, rounded up to whole 128-byte lines."""
    return -(-(head_dim + 2) // RECORD_PAD) * RECORD_PAD


def score_parts(cells: int, head_dim: int, group: int, n_threads: int = STEP_THREADS) -> int:
    """Threads per cell in the scores: as many as the block has for the split's cells, a
    power of two dividing head_dim, while the partial scores fit SCORE_VALUES."""
    parts = 1
    while (parts * 2 * cells <= n_threads and head_dim % (parts * 2) == 0
           and parts * 2 * cells * group <= SCORE_VALUES):
        parts *= 2
    return parts


def split_lanes(head_dim: int, group: int, n_threads: int = STEP_THREADS) -> int:
    """Threads per output dim in the V sums and the merge (each takes every lanes-th cell
    or split): 4 for 256 threads and D = 64, while the lanes' sums fit SCORE_VALUES."""
    lanes = max(1, n_threads // head_dim)
    while lanes > 1 and lanes * group * head_dim > SCORE_VALUES:
        lanes //= 2
    return lanes


def padded_splits(n_columns: int, per_split: int, head_dim: int, group: int) -> int:
    """Splits for n_columns selected blocks, rounded up so each merging thread's share is
    whole rounds of MERGE_UNROLL (the extra splits see nothing: weight 0)."""
    unit = split_lanes(head_dim, group) * MERGE_UNROLL
    return -(-max(1, -(-n_columns // per_split)) // unit) * unit


def max_cells(head_dim: int, group: int) -> int:
    """The most cells one query's list may cover at the default split: the merge keeps a
    weight per (head, split) in the K tile (K_TILE_VALUES), in whole merge rounds. The
    backend checks --max-context against it."""
    per_split = default_per_split(head_dim)
    unit = split_lanes(head_dim, group) * MERGE_UNROLL
    return K_TILE_VALUES // group // unit * unit * per_split * BLOCK


# --8<-- [start:attention_step_kernel]
def make_attention_step_kernel(read_k, read_v, G, D, per_split, per_sm=3):
    """The kernel for one format (how it reads a column of K and of V: kv_readers.py), G
    query heads per KV head, head_dim D, `per_split` selected blocks per split and
    `per_sm` thread blocks an SM (3: as the compiler builds it; 2: launch bounds that let
    each thread have up to 128 registers). All
    are compiled in, with the block's thread count: the loops over heads unroll and a
    thread's G sums live in registers, and every index is divided by a constant. (Numba
    does integer arithmetic in 64 bits; a division by a value known only at run time,
    a loop's trip count over a runtime stride included, is a long software routine.)"""
    LANES = split_lanes(D, G)
    N_THREADS = STEP_THREADS
    N_WARPS = N_THREADS // WARP
    CELLS = per_split * BLOCK
    PARTS = score_parts(CELLS, D, G)
    SPAN = D // PARTS  # terms of a score's dot each of its PARTS threads adds

    # --8<-- [start:step_write_output]
    @cuda.jit(device=True)
    def write_output(dots,     # [(lane * G + g) * D + d]: the head rows' sums, by lane
                     total,    # [g]: each head's sum of weights
                     merged,   # (MAX_GROUP, >= D) shared scratch
                     out, i, kv_h, t, rotate):
        """The lanes' sums added in lane order over each head's weight (0 with none),
        rotated when asked, into out: the merge's end, and a lone split's."""
        for e in range(t, G * D, N_THREADS):
            g, d = e // D, e % D
            x = float32(0.0)
            for ls in range(LANES):
                x += dots[(ls * G + g) * D + d]
            merged[g, d] = x / total[g] if total[g] > 0 else float32(0.0)
        cuda.syncthreads()
        if rotate == 1:
            fwht64_rows(merged, G, D, t, N_THREADS)
        for e in range(t, G * D, N_THREADS):
            g, d = e // D, e % D
            out[i, kv_h * G + g, d] = merged[g, d]
    # --8<-- [end:step_write_output]

    # --8<-- [start:step_write_record]
    @cuda.jit(device=True)
    def write_record(dots, top, total, seen, dst, i, kv_h, slot, t):
        """A record at dst[i, kv_h, slot]: the lanes' V sums added in lane order, each
        head's max and sum of weights; with seen == 0 an empty one (sums 0, max -inf,
        sum 0), which a merge weighs 0."""
        for e in range(t, G * D, N_THREADS):
            g, d = e // D, e % D
            x = float32(0.0)
            if seen == 1:
                for lc in range(LANES):
                    x += dots[(lc * G + g) * D + d]
            dst[i, kv_h, slot, g, d] = x
        for g in range(t, G, N_THREADS):
            dst[i, kv_h, slot, g, D] = top[g] if seen == 1 else NEG_INF
            dst[i, kv_h, slot, g, D + 1] = total[g] if seen == 1 else float32(0.0)
    # --8<-- [end:step_write_record]

    # --8<-- [start:step_merge]
    UNIT = LANES * MERGE_UNROLL  # records a round of the V sums takes: count is a multiple of it
    MAXIMA_UNROLL = 4  # records a lane of the maxima's pass loads at once: 128 a warp, a round
    W = record_width(D)  # floats a (split, head) record takes

    @cuda.jit(device=True)
    def merge_records(flat, rec0, count, split_w, top, total, seen_end, dots, ahead, acc, t):
        """The merge of records rec0 .. rec0 + count - 1 of the flat records (record s's value v
        for head g at flat[((rec0 + s) * G + g) * W + v]: its V sums, max m and sum of
        weights l; count a multiple of UNIT, records past the last real one empty) by one
        thread block, each rescaled to the largest max: each head's merged max into top and
        sum of weights into total, the lanes' weighted V sums into dots. A record that saw
        no cell has m = -inf and l = sums = 0: weight 0. One warp per head reads every
        record's max, finds the head's max and the end of the records that saw anything (a
        short context in a long list leaves most of them empty), then weighs each record up
        to that end (its max again, now from L1) and adds the weighted sums of weights: no
        barrier between the two passes. In both, a lane loads MAXIMA_UNROLL records before
        it uses one, so their loads wait on memory together, not one after another (128
        records at 8K cells: one wait a pass, not four), and adds them in the same order.

        The records are read through the flat view, not as a 5-D array: G and W are
        constants, so the loads of a round share one address at constant offsets, where a
        5-D index's runtime strides would give each load an address, and registers, of its
        own. Fewer registers a thread let more thread blocks share an SM."""
        warp, lane = t // WARP, t % WARP
        maxima = cuda.local.array(MAXIMA_UNROLL, float32)  # a lane's records s0, s0 + 32, ...: loaded together
        sums = cuda.local.array(MAXIMA_UNROLL, float32)
        for g0 in range(0, G, N_WARPS):
            g = g0 + warp
            m, last_seen = NEG_INF, float32(0.0)
            if g < G:
                for s0 in range(lane, count, MAXIMA_UNROLL * WARP):
                    for u in range(MAXIMA_UNROLL):
                        s = s0 + u * WARP
                        maxima[u] = flat[((rec0 + s) * G + g) * W + D] if s < count else NEG_INF
                    for u in range(MAXIMA_UNROLL):
                        m = max(m, maxima[u])
                        if maxima[u] > NEG_INF:
                            last_seen = float32(s0 + u * WARP + 1)
            m = warp_max(m)
            last_seen = warp_max(last_seen)  # a float: the warp reductions take float32
            l = float32(0.0)
            if g < G:
                for s0 in range(lane, count, MAXIMA_UNROLL * WARP):
                    for u in range(MAXIMA_UNROLL):
                        s = s0 + u * WARP
                        maxima[u], sums[u] = NEG_INF, float32(0.0)
                        if s < count and s < last_seen:  # past it every record's weight is 0: no loads
                            maxima[u] = flat[((rec0 + s) * G + g) * W + D]
                            sums[u] = flat[((rec0 + s) * G + g) * W + D + 1]
                    for u in range(MAXIMA_UNROLL):  # in order of s, as one record at a time
                        w = float32(0.0)
                        if maxima[u] > NEG_INF:
                            w = math.exp(maxima[u] - m)
                            l += sums[u] * w
                        if s0 + u * WARP < count:
                            split_w[g * count + s0 + u * WARP] = w
            l = warp_sum(l)
            if g < G and lane == 0:
                top[g], seen_end[g], total[g] = m, int(last_seen), l
        cuda.syncthreads()
        end = 0
        for g in range(G):
            end = max(end, seen_end[g])
        end = -(-end // UNIT) * UNIT  # whole rounds, up to count at most
        # Thread (lane_s, d) adds every LANES-th record for all G heads, MERGE_UNROLL records
        # at a time: their loads go out together.
        for e in range(t, LANES * D, N_THREADS):
            ls, d = e // D, e % D
            for g in range(G):
                acc[g] = float32(0.0)
            for s0 in range(ls, end, UNIT):
                for u in range(MERGE_UNROLL):
                    for g in range(G):
                        ahead[u, g] = flat[((rec0 + s0 + u * LANES) * G + g) * W + d]
                for u in range(MERGE_UNROLL):
                    for g in range(G):
                        acc[g] += ahead[u, g] * split_w[g * count + s0 + u * LANES]
            for g in range(G):
                dots[(ls * G + g) * D + d] = acc[g]
        cuda.syncthreads()
    # --8<-- [end:step_merge]

    # the simulator takes no launch bounds (and has no registers to give)
    bounds = {} if per_sm == 3 or SIMULATED else {"launch_bounds": (N_THREADS, per_sm)}

    @cuda.jit(cache=True, **bounds)
    def attention_step_kernel(q,           # (Q, G * n_kv, D) float32
                              q_pos,       # (Q,) int32
                              blocks,      # (Q, S) int32, -1 = padding
                              page_table,  # (n_logical_blocks,) int32
                              scale,       # float32: 1 / sqrt(D)
                              ordered,     # int32: 1 = each row of blocks ascends, its -1 padding at the end
                              rotate,      # int32: 1 = apply H to each output head row
                              pool_ka, pool_kb, pool_va, pool_vb,  # K and V of the pool, by slot
                              host_ka, host_kb, host_va, host_vb,  # the same by logical block, or (0, ...)
                              records,     # (Q, n_kv, n_splits, G, record_width(D)) float32 scratch
                              flat,        # (records.size,) float32: the same memory, for the merge's loads
                              arrivals,    # (Q, n_kv) int32: 0 before the launch, 0 after it
                              out):        # (Q, G * n_kv, D) float32, written
        # Which build this is, in its closure (its code never reads it): Numba's disk cache
        # tells two kernels of one factory apart by their closures, not their launch bounds.
        _ = per_sm
        # A dependent launch may have started it early: q, the list and the cells are the
        # kernels' before it (fast/dependent_launch.py). It lets the next kernel start only
        # once its split's record is written (at the tickets, below), not here.
        wait_for_inputs()
        i, kv_h, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        t = cuda.threadIdx.x  # of N_THREADS: the launch gives that many
        warp, lane = t // WARP, t % WARP
        n_splits = cuda.gridDim.z  # a thread block per split: records.shape[2]
        pos = q_pos[i]
        q_g = cuda.shared.array(Q_VALUES, float32)  # q_g[g * D + j]: head kv_h * G + g
        k_tile = cuda.shared.array(K_TILE_VALUES, float32)  # k_tile[c * (D + 1) + j]: cell c of the split
        v_tile = cuda.shared.array(V_TILE_VALUES, float32)  # v_tile[c * D + d]
        dots = cuda.shared.array(SCORE_VALUES, float32)  # [(p * G + g) * CELLS + c] partial scores
        weights = cuda.shared.array((MAX_GROUP, MAX_SPLIT_CELLS), float32)  # exp weights, -1 = masked
        row = cuda.shared.array(MAX_SPLIT_BLOCKS, int32)  # column s is read at slot (or block) row[s]
        alone = cuda.shared.array(1, int32)  # 1 = a lone split (below)
        from_host = cuda.shared.array(MAX_SPLIT_BLOCKS, int32)  # ... of the host copy when 1
        start = cuda.shared.array(MAX_SPLIT_BLOCKS, int32)  # its first cell's position, -1 = unseen
        top = cuda.shared.array(MAX_GROUP, float32)  # each head's max, then the merged max
        total = cuda.shared.array(MAX_GROUP, float32)  # each head's sum of weights, then merged
        seen_end = cuda.shared.array(MAX_GROUP, int32)  # the merge: 1 + the last split each head saw
        column = cuda.local.array(BLOCK, float32)  # value u of one block's 16 K rows
        v_column = cuda.local.array(BLOCK, float32)  # ... and of its 16 V rows
        acc = cuda.local.array(G, float32)  # this thread's sum for each head (registers: G is fixed)
        ahead = cuda.local.array((MERGE_UNROLL, G), float32)  # the merge's loads in flight

        # --8<-- [start:step_lone_split]
        # A lone split: in an ordered list whose column per_split is unseen (padding, or
        # after the query), no split but the first sees a cell. The others leave, and the
        # first writes the output itself: no records, no ticket, no merge. Every thread
        # block of the query reads that one column, beside its own, so all decide alike
        # and none waits longer for its list.
        if t == N_THREADS - 1:
            b = blocks[i, per_split] if ordered == 1 and per_split < blocks.shape[1] else -1
            alone[0] = 1 if ordered == 1 and (b < 0 or b * BLOCK > pos) else 0
        first = split * per_split
        for s in range(t, per_split, N_THREADS):
            b = blocks[i, first + s] if first + s < blocks.shape[1] else -1
            seen = b >= 0 and b * BLOCK <= pos  # padding, or a block wholly after the query: unseen
            slot = page_table[b] if seen else -1
            start[s] = b * BLOCK if seen else -1
            row[s] = slot if slot >= 0 else b
            from_host[s] = 1 if slot < 0 else 0
        cuda.syncthreads()
        lone = alone[0]
        if lone == 1 and split > 0:
            return  # the whole thread block, past its only barrier so far
        # --8<-- [end:step_lone_split]

        # --8<-- [start:step_split]
        # A split that sees no cell (a replayed resident step lists every block of the
        # cache, so at a short context most splits are past the query) skips to its
        # record: sums 0, m = -inf, l = 0, which the merge weighs 0.
        seen_any = 0
        for s in range(per_split):
            if start[s] >= 0:
                seen_any = 1
        if seen_any == 1:  # the same for every thread: the barriers inside are reached by all
            for e in range(t, G * D, N_THREADS):
                q_g[e] = q[i, kv_h * G + e // D, e % D]
            # Unpack: thread (s, u) reads value u of block s's 16 K rows and of its 16 V rows,
            # both before it stores either, and picks the memory (VRAM slot or host copy) by
            # a select, not a branch, so all 32 loads wait on memory together. All 16 cells,
            # even those after the query (unwritten bytes, maybe NaN): their scores are never
            # computed and their V never weighted.
            for e in range(t, per_split * D, N_THREADS):
                s, u = e // D, e % D
                if start[s] >= 0:
                    r, host = row[s], from_host[s] == 1
                    ka, kb = (host_ka, host_kb) if host else (pool_ka, pool_kb)
                    va, vb = (host_va, host_vb) if host else (pool_va, pool_vb)
                    read_k(ka, kb, r, kv_h, u, column)
                    read_v(va, vb, r, kv_h, u, v_column)
                    for c in range(BLOCK):
                        k_tile[(s * BLOCK + c) * (D + 1) + u] = column[c]
                        v_tile[(s * BLOCK + c) * D + u] = v_column[c]
            cuda.syncthreads()

            # Partial scores: thread (p, c) dots part p of cell c's K row with all G query rows
            # (each K value read once for the G heads). Cells after the query are skipped.
            for e in range(t, PARTS * CELLS, N_THREADS):
                p, c = e // CELLS, e % CELLS
                s = c // BLOCK
                if start[s] >= 0 and start[s] + c % BLOCK <= pos:
                    for g in range(G):
                        acc[g] = float32(0.0)
                    for jj in range(SPAN):  # a constant trip count: the loop unrolls
                        j = p * SPAN + jj
                        k = k_tile[c * (D + 1) + j]
                        for g in range(G):
                            acc[g] += q_g[g * D + j] * k
                    for g in range(G):
                        dots[(p * G + g) * CELLS + c] = acc[g]
            cuda.syncthreads()

            # Softmax of each head over the split's cells, one warp per head (rounds of
            # N_WARPS heads, so every warp reaches each reduction together). A masked cell's
            # weight is -1 for every head: its V is never read.
            for g0 in range(0, G, N_WARPS):
                g = g0 + warp
                m = NEG_INF
                if g < G:
                    for c in range(lane, CELLS, WARP):
                        x = NEG_INF
                        if start[c // BLOCK] >= 0 and start[c // BLOCK] + c % BLOCK <= pos:
                            x = float32(0.0)
                            for p in range(PARTS):
                                x += dots[(p * G + g) * CELLS + c]
                            x *= scale
                        weights[g, c] = x
                        m = max(m, x)
                m = warp_max(m)
                l = float32(0.0)
                if g < G:
                    for c in range(lane, CELLS, WARP):
                        x = weights[g, c]
                        if x > NEG_INF:
                            x = math.exp(x - m)
                            l += x
                        else:
                            x = float32(-1.0)
                        weights[g, c] = x
                l = warp_sum(l)
                if g < G and lane == 0:
                    top[g], total[g] = m, l
            cuda.syncthreads()

            # This split's record: thread (lane_c, d) sums V[c, d] over every LANES-th cell for
            # all G heads; the lanes' sums meet in shared memory (dots), added in lane order.
            for e in range(t, LANES * D, N_THREADS):
                lc, d = e // D, e % D
                for g in range(G):
                    acc[g] = float32(0.0)
                for c in range(lc, CELLS, LANES):
                    if weights[0, c] >= 0:  # a masked cell may hold NaN: 0 * NaN is NaN
                        v = v_tile[c * D + d]
                        for g in range(G):
                            acc[g] += weights[g, c] * v
                for g in range(G):
                    dots[(lc * G + g) * D + d] = acc[g]
            cuda.syncthreads()
        # --8<-- [end:step_split]
        # --8<-- [start:step_lone_output]
        if lone == 1:  # the V sums by lane are in dots, each head's sum of weights in total
            if seen_any == 0:
                for g in range(t, G, N_THREADS):
                    total[g] = float32(0.0)  # no cell: the output is 0, as the merge gives
                cuda.syncthreads()
            write_output(dots, total, weights, out, i, kv_h, t, rotate)
            return
        # --8<-- [end:step_lone_output]
        # --8<-- [start:step_record]
        # This split's record: its V sums (the lanes' added in lane order), max and sum.
        write_record(dots, top, total, seen_any, records, i, kv_h, split, t)
        # --8<-- [end:step_record]
        # --8<-- [start:step_tickets]
        # The next kernel (the o matvec) may launch once every thread block is here or has
        # ended (a lone split ends first). Not earlier: its blocks would be placed on the SMs
        # while the splits still run, and wait there (docs: "From plain to fast").
        let_next_start()
        # The ticket: the block that draws the last of the (query, KV head)'s merges every record.
        split_w = k_tile  # the tiles are done with: record s's weight for head g at [g * count + s]
        if last_to_arrive(arrivals, (i, kv_h), n_splits) == 0:
            return
        first_record = (i * cuda.gridDim.y + kv_h) * n_splits  # (i, kv_h, 0)'s, in the flat records
        merge_records(flat, first_record, n_splits, split_w, top, total, seen_end, dots, ahead, acc, t)
        write_output(dots, total, weights, out, i, kv_h, t, rotate)
        # --8<-- [end:step_tickets]

    return waits_for_inputs(attention_step_kernel)
# --8<-- [end:attention_step_kernel]


# One kernel per (format, G, head_dim, blocks per split, thread blocks an SM), made at
# import so a sm_90 compile can find them; Numba compiles each on its first launch.
SPLIT_CHOICES = (1, 2, 4)  # blocks per split a launch may ask for (and the tiles hold)
PER_SM_CHOICES = (2, 3)  # thread blocks an SM a build is made for
STEP_KERNELS = {(fmt, g, d, n, m): make_attention_step_kernel(READERS[k], READERS[v], g, d, n, m)
                for fmt, (k, v) in SIDES.items() for g in range(1, MAX_GROUP + 1) for d in HEAD_DIMS
                for n in SPLIT_CHOICES if n <= split_fits(d) for m in PER_SM_CHOICES}


# --8<-- [start:blocks_per_sm]
def blocks_per_sm(thread_blocks: int) -> int:
    """Which build a launch gets: 2 an SM when `thread_blocks`, those of its splits that can
    see a cell, fit two to every SM (one wave of the build with more registers), else 3."""
    return 2 if thread_blocks <= 2 * multiprocessors() else 3


def default_per_split(head_dim: int) -> int:
    """Selected blocks per split when the caller does not say: as many as the tiles hold,
    up to STEP_BLOCKS_PER_SPLIT."""
    return min(STEP_BLOCKS_PER_SPLIT, split_fits(head_dim))


def two_per_sm_columns(n_kv: int, head_dim: int) -> int:
    """The widest list of blocks (columns) whose splits, for one query, all fit two thread
    blocks to an SM: a decode step whose query sees no further reads a list this wide and
    gets the two-an-SM build. 0 when even one split per KV head does not fit."""
    return 2 * multiprocessors() // n_kv * default_per_split(head_dim)
# --8<-- [end:blocks_per_sm]


def attention_step(fmt, n_kv, args, sides, out, rotate_out: bool, per_split: int | None, ordered: bool = False):
    """Launch the step kernel; attention() (fast/attention.py) has checked the arrays and
    moved them. args: (q, q_pos, blocks, page_table, scale), sides: the eight pool and host
    arrays (kv_readers.py: side_arrays), out: the device output. per_split None = the default.
    ordered: every row of blocks ascends with its -1 padding at the end, so a query whose
    cells all lie in its first split skips the merge (the kernel's lone split)."""
    q, blocks = args[0], args[2]
    n_q, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    fits = split_fits(head_dim)
    per_split = default_per_split(head_dim) if per_split is None else per_split
    assert per_split in SPLIT_CHOICES and per_split <= fits, \
        f"per_split {per_split} is not one of {SPLIT_CHOICES} up to {fits} (the shared tiles)"
    assert group <= MAX_GROUP and head_dim in HEAD_DIMS, \
        f"no step kernel for {group} query heads per KV head of {head_dim} (built: <= {MAX_GROUP}, {HEAD_DIMS})"
    n_splits = padded_splits(blocks.shape[1], per_split, head_dim, group)
    assert group * n_splits <= K_TILE_VALUES, f"{n_splits} splits: raise per_split for the merge's weights"
    records = device_empty((n_q, n_kv, n_splits, group, record_width(head_dim)), np.float32)
    # the splits past the list's last column (padding for the merge) see no cell
    per_sm = blocks_per_sm(n_q * n_kv * -(-blocks.shape[1] // per_split))
    STEP_KERNELS[fmt, group, head_dim, per_split, per_sm][(n_q, n_kv, n_splits), STEP_THREADS, stream()](
        *args, np.int32(ordered), np.int32(rotate_out), *sides, records, records.reshape(records.size),
        ticket_counters("attention_step", (n_q, n_kv)), out)
