"""Plain twin: kernels/step/select_rows.py select_rows_kernel (QSA's choice, one thread
block a query). This one selects for a graph-replayed decode step: it also gives every
block up to the query when there is no budget, counts the lookups, ranks NaN scores as
the host does, and spreads the ranking over the GPU instead of one SM's rounds.

The host path picks blocks from the step's scores (`select_rows_ref`, kernels/step/
select_rows.py, run by KVCache.select): block 0, the window (the last `window_blocks`
blocks up to the query) and, of the rest, the highest scores up to the budget, ties to
the lower block (a stable sort); or, with no budget, every block up to the query. A graph
cannot call Python between its kernels, so this kernel makes the same choice from the
scores in device memory and writes the list the attention kernel reads, ascending and -1
padded to a fixed width. A missing block needs no copy here: attention reads it in place
from the host copy (mapped pinned memory), the same bytes the host path would first copy
into a slot. So the two paths attend over the same bytes in the same order and give the
same bits.

It also counts, for the cache's counters, how many blocks the step looked up and how many
of those were not in VRAM (all of them read in place).

Block b is chosen if it is in the window or block 0, or if fewer than `take` other
candidates outrank it: a higher score, or the same score and a lower index (a NaN score
below every number, where NumPy sorts it). That rank is the block's place in the stable
sort, so the choice is the host's. Ranking every candidate against every other is n^2
comparisons (about 240,000 at 8K of context): too many for one SM, and a chain of one
SM's barriers would leave the rest of the GPU idle. So they are spread over the GPU: a
thread block ranks 4 blocks, 64 threads per block, each thread comparing against every
64th candidate, from a copy of the scores in shared memory. (Every thread block copies
all the scores first, which is why a thread block ranks a few blocks, not one.) Each
chosen block's place in the list is the number of chosen blocks before it; the thread
block that finishes last (a ticket, gpu/launch.py: `last_to_arrive`, as in the step
attention's merge in kernels/attention/) writes the list: each of its threads owns a
contiguous run of blocks, and a scan over the threads' pick counts gives each run its
start.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from strata_nb.gpu.launch import DeviceArgs, expect, last_to_arrive, stream, ticket_counters
from strata_nb.gpu.geometry import SELECT_CANDIDATES, SELECT_PARTS, SELECT_SHARED_SCORES
from strata_nb.kernels.step.select_rows import select_rows_ref
from strata_nb.kv_layout import BLOCK, all_blocks_upto

# A thread block ranks CANDIDATES blocks, PARTS threads each (under the simulator fewer
# Python threads: 8 x 4).
CANDIDATES = SELECT_CANDIDATES
PARTS = SELECT_PARTS
THREADS = CANDIDATES * PARTS
# Candidates whose scores a thread block holds in shared memory (4,096 blocks: 64K cells
# of context); the scores of later ones are read from global memory.
SHARED_SCORES = SELECT_SHARED_SCORES


# --8<-- [start:select_blocks_ref]
def select_blocks_ref(scores,      # (1, n_blocks) float32 (unread when dense)
                      q_pos,       # (1,) int32: the step's position
                      page_table,  # (n_blocks,) int32 slot, -1 = not in VRAM
                      window_blocks, budget_cells,  # int: --kv-window // 16, --qsa-budget (0 = dense)
                      chosen,      # (n_blocks,) int32 scratch, written: 1 = selected
                      out,         # (1, width) int32, written: the selection ascending, -1 padded
                      counts):     # (3,) int64, added to: blocks looked up, of which not in VRAM, and 1
    if budget_cells == 0:
        sel = all_blocks_upto(q_pos)[0]
    else:
        sel = select_rows_ref(np.asarray(scores), q_pos, window_blocks, budget_cells)[0]
    sel = sel[sel >= 0]
    assert len(sel) <= out.shape[1], f"{len(sel)} blocks selected; the list holds {out.shape[1]}"
    chosen[:] = 0
    chosen[sel] = 1
    out[0, :] = -1
    out[0, :len(sel)] = sel
    counts[0] += len(sel)
    counts[1] += int((page_table[sel] < 0).sum())
    counts[2] += 1  # one selection: a layer's step
# --8<-- [end:select_blocks_ref]


# --8<-- [start:select_blocks_kernel]
@cuda.jit(device=True)
def outranks(other, c, mine, b):
    """Whether candidate c (score `other`) comes before block b (score `mine`) in the
    host's stable sort of -scores: a higher score, or the same score and a lower index.
    NumPy sorts NaN after every number (NaNs among themselves by index); a plain `>`
    would rank a NaN score before them all, and pick more blocks than the list holds."""
    if math.isnan(mine):
        return not math.isnan(other) or c < b
    return other > mine or (other == mine and c < b)


@cuda.jit(cache=True)
def select_blocks_kernel(scores, q_pos, page_table, window_blocks, budget_cells, chosen, out, counts,  # as select_blocks_ref
                         arrivals):  # (1,) int32 ticket counter: 0 before the launch, 0 after it
    # A plain launch, not a dependent one (fast/dependent_launch.py: kernels that end in one
    # thread block): this kernel starts when block_scores has ended, and the step attention
    # after it when it has ended.
    t = cuda.threadIdx.x
    n_blocks = chosen.shape[0]
    last = q_pos[0] // BLOCK
    first_window = max(0, last - window_blocks + 1)
    n_always = last - first_window + 1 + (1 if first_window > 0 else 0)  # the window, and block 0
    take = max(0, max(1, budget_cells // BLOCK) - n_always)

    # Rank: threads (j, 0 .. PARTS-1) count the candidates that outrank block b, each
    # over every PARTS-th candidate: a higher score, or the same score and a lower index
    # (`outranks`).
    # The candidates' scores are read by every thread: first into shared memory.
    j, p = t // PARTS, t % PARTS
    b = cuda.blockIdx.x * CANDIDATES + j
    cand = cuda.shared.array(SHARED_SCORES, float32)
    if budget_cells > 0 and cuda.blockIdx.x * CANDIDATES < first_window:  # this block ranks some
        for c in range(t, min(first_window, SHARED_SCORES), THREADS):
            cand[c] = scores[0, c]
    cuda.syncthreads()
    candidate = budget_cells > 0 and 0 < b < first_window
    beaten = 0
    if candidate:
        mine = scores[0, b]
        for c in range(1 + p, first_window, PARTS):
            other = cand[c] if c < SHARED_SCORES else scores[0, c]
            if outranks(other, c, mine, b):
                beaten += 1
    parts = cuda.shared.array((CANDIDATES, PARTS), int32)
    parts[j, p] = beaten
    cuda.syncthreads()
    if p == 0 and b < n_blocks:
        pick = 0
        if b <= last:
            if candidate:
                rank = 0
                for u in range(PARTS):
                    rank += parts[j, u]
                pick = 1 if rank < take else 0
            else:  # dense, block 0 or the window
                pick = 1
        chosen[b] = pick

    # The ticket: the block that draws the last one writes the list.
    if last_to_arrive(arrivals, 0, cuda.gridDim.x) == 0:
        return

    # Each chosen block's place in the list is the number of chosen blocks before it:
    # thread t owns a contiguous run of blocks, and a scan over the threads' pick counts
    # gives each run its start.
    per_thread = (n_blocks + THREADS - 1) // THREADS
    mine_from, mine_to = min(n_blocks, t * per_thread), min(n_blocks, (t + 1) * per_thread)
    n_mine = 0
    for b in range(mine_from, mine_to):
        n_mine += chosen[b]
    picks = cuda.shared.array((2, THREADS), int32)  # two rows: each round reads one, writes the other
    picks[0, t] = n_mine
    cuda.syncthreads()
    row, step = 0, 1
    while step < THREADS:
        picks[1 - row, t] = picks[row, t] + (picks[row, t - step] if t >= step else 0)
        row = 1 - row
        step *= 2
        cuda.syncthreads()
    place = picks[row, t] - n_mine  # picks of threads 0 .. t-1
    missing = 0
    for b in range(mine_from, mine_to):
        if chosen[b] == 1:
            out[0, place] = b
            place += 1
            if page_table[b] < 0:
                missing += 1
    for k in range(picks[row, THREADS - 1] + t, out.shape[1], THREADS):
        out[0, k] = -1  # the padding after the list
    if n_mine > 0:
        cuda.atomic.add(counts, 0, n_mine)
        cuda.atomic.add(counts, 1, missing)
    if t == 0:
        cuda.atomic.add(counts, 2, 1)
# --8<-- [end:select_blocks_kernel]


def select_blocks(scores, q_pos, page_table, window_blocks: int, budget_cells: int, chosen, out, counts):
    """Like select_blocks_ref, on the device (one decode query)."""
    n_blocks = page_table.shape[0]
    expect("scores", scores, np.float32, (1, n_blocks))
    expect("q_pos", q_pos, np.int32, (1,))
    expect("chosen", chosen, np.int32, (n_blocks,))
    expect("out", out, np.int32, (1, None))
    expect("counts", counts, np.int64, (3,))
    with DeviceArgs() as dev:
        select_blocks_kernel[(n_blocks + CANDIDATES - 1) // CANDIDATES, THREADS, stream()](
            dev.read(scores), dev.read(q_pos), dev.read(page_table), np.int32(window_blocks),
            np.int32(budget_cells), dev.write(chosen), dev.write(out), dev.write(counts),
            ticket_counters("select_blocks", (1,)))
