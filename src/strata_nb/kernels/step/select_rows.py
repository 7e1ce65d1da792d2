"""QSA's block selection (strata-nb's own): which blocks of the context a query reads.

A query reads block 0 (where attention sinks sit), the recent window (the last
`window_blocks` blocks up to its own) and, of the blocks between them, the ones that score
highest (block_scores.py) until it holds `budget_cells` cells; equal scores go to the
lower block, as a stable sort orders them. The list is ascending and -1 padded, the form
the attention kernels read.

The kernel gives each query one thread block. The candidates' scores stay in global
memory; round r finds the r-th best candidate as the best of those ranked after round
r - 1's pick (a lower score, or the same score and a higher block), so nothing needs
marking: each thread keeps the best of its share (every THREADS-th block), and two block
reductions give the round's best score and the lowest block that holds it (argmax.py's
`first_of_max`). After `take` rounds, the last pick is the cut: a candidate is chosen
when it ranks at or before it. Thread 0 then walks the candidates in block order and
writes the chosen ones, while the block's threads write the window and the padding.

The output is block indices, so the kernel must equal the reference exactly. Scores are
numbers (-inf included): a NaN has no place in the order the rounds compare by.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import SELECT_ROWS_THREADS
from strata_nb.gpu.launch import DeviceArgs, expect, is_host_numpy, stream
from strata_nb.kernels.step.argmax import first_of_max
from strata_nb.kv_layout import BLOCK

# Threads per query: 256 on a GPU, 32 under the simulator (each a Python thread)
THREADS = SELECT_ROWS_THREADS


# --8<-- [start:select_rows_ref]
def candidates(pos, window_blocks: int) -> range:
    """The blocks a query at `pos` ranks: not block 0 and not the window (both always
    read), nothing after the query. Only these need a score."""
    return range(1, max(1, pos // BLOCK - window_blocks + 1))


def budget_note(budget_cells: int, window_blocks: int) -> str | None:
    """What a query reads when the budget does not say it plainly, else None: the budget is
    whole blocks (rounded down), and the first block and the window are read whatever it is."""
    always = (1 + window_blocks) * BLOCK
    if budget_cells >= always and budget_cells % BLOCK == 0:
        return None
    if budget_cells < always:
        return (f"--qsa-budget {budget_cells} is below what a query always reads, the first block and the "
                f"--kv-window of {window_blocks * BLOCK} cells, so selection adds no block (a query reads at most "
                f"{always} cells)")
    return (f"--qsa-budget {budget_cells} is not whole blocks of {BLOCK} cells: a query reads "
            f"at most {budget_cells // BLOCK * BLOCK}")


def select_rows_ref(scores: np.ndarray, positions: np.ndarray, window_blocks: int, budget_cells: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """QSA's choice for each query: the first block, the recent window, then the best-scoring
    others until the budget. scores (n_q, n_blocks) float32, positions (n_q,) -> (n_q, width)
    int32 ascending, -1 padded: written into `out` when given (as the kernel writes it), else
    made as wide as the longest row."""
    budget_blocks = max(1, budget_cells // BLOCK)
    rows = []
    for score, pos in zip(scores, positions):
        last = int(pos) // BLOCK
        ranked = candidates(int(pos), window_blocks)
        always = set(range(last + 1)) - set(ranked)  # block 0 and the window
        others = [b for b in np.argsort(-score[: last + 1], kind="stable") if b in ranked]
        take = max(0, budget_blocks - len(always))
        rows.append(sorted(always | {int(b) for b in others[:take]}))
    if out is None:
        out = np.empty((len(rows), max(map(len, rows))), np.int32)
    out[...] = -1
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
# --8<-- [end:select_rows_ref]


# --8<-- [start:select_rows_kernel]
@cuda.jit(cache=True)
def select_rows_kernel(scores,         # (n_q, n_blocks) float32: -inf where not a candidate
                       positions,      # (n_q,) int32: each query's position
                       window_blocks,  # int32: the window's blocks (--kv-window // 16)
                       budget_cells,   # int32: --qsa-budget
                       out):           # (n_q, width) int32, written: ascending, -1 padded
    i, t = cuda.blockIdx.x, cuda.threadIdx.x
    n_blocks = scores.shape[1]
    last = positions[i] // BLOCK
    ranked_end = max(1, last - window_blocks + 1)  # candidates: blocks 1 .. ranked_end - 1
    n_always = last + 2 - ranked_end  # block 0 and the window ranked_end .. last
    take = min(ranked_end - 1, max(0, max(1, budget_cells // BLOCK) - n_always))

    # Round r: the best candidate ranked after the cut (round r - 1's pick). The first
    # round's cut, (+inf, -1), has every candidate after it.
    cut_score, cut_block = float32(math.inf), -1
    for _ in range(take):
        best, best_b = float32(-math.inf), n_blocks  # n_blocks: none yet
        for b in range(1 + t, ranked_end, THREADS):  # ascending: a tie keeps the lower block
            s = scores[i, b]
            after_cut = s < cut_score or (s == cut_score and b > cut_block)
            if after_cut and (s > best or best_b == n_blocks):
                best, best_b = s, b
        cut_score, cut_block = first_of_max(best, best_b, n_blocks)  # the same in every thread

    # The list: block 0, the chosen candidates in block order, then the window.
    for b in range(ranked_end + t, last + 1, THREADS):
        out[i, 1 + take + b - ranked_end] = b
    for k in range(n_always + take + t, out.shape[1], THREADS):
        out[i, k] = -1
    if t == 0:
        out[i, 0] = 0
        place = 1
        for b in range(1, ranked_end):  # with no round, the cut (+inf, -1) has none before it
            s = scores[i, b]
            if s > cut_score or (s == cut_score and b <= cut_block):  # at or before the cut
                out[i, place] = b
                place += 1
# --8<-- [end:select_rows_kernel]


def select_width(n_blocks: int, window_blocks: int, budget_cells: int) -> int:
    """The most blocks a row can hold: the budget's blocks, or block 0 and the window when
    they are more, and never more than the context's blocks."""
    return min(n_blocks, max(max(1, budget_cells // BLOCK), 1 + window_blocks))


def select_rows(scores, positions, window_blocks: int, budget_cells: int, out):
    """Like select_rows_ref, on the device, into `out` (n_q, select_width(...)) or wider.
    NumPy arguments are moved (out is written back)."""
    expect("scores", scores, np.float32, (None, None))
    n_q, n_blocks = scores.shape
    expect("positions", positions, np.int32, (n_q,))
    expect("out", out, np.int32, (n_q, None))
    width = select_width(n_blocks, window_blocks, budget_cells)
    assert out.shape[1] >= width, f"out holds {out.shape[1]} blocks a row; a row can hold {width}"
    if is_host_numpy(positions):
        assert (positions >= 0).all() and (positions < n_blocks * BLOCK).all(), "a position past the scores"
    if n_q == 0:
        return
    with DeviceArgs() as dev:
        select_rows_kernel[n_q, THREADS, stream()](dev.read(scores), dev.read(positions), np.int32(window_blocks),
                                                   np.int32(budget_cells), dev.write(out))
