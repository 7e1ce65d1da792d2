"""Which blocks each query reads.

Dense (`--qsa-budget 0`): every block up to the query's position. QSA (strata-nb's own,
Quest-style): the first block and the recent window always, then the best-scoring other
blocks (kernels/block_scores.py) until the budget in cells is spent.
"""
from __future__ import annotations

import numpy as np

from .formats import BLOCK


def all_blocks_upto(positions: np.ndarray) -> np.ndarray:
    """(n,) positions -> (n, max_block + 1) int32: each query's blocks 0..pos//BLOCK, -1 padded."""
    last = np.asarray(positions) // BLOCK
    cols = np.arange(int(last.max()) + 1, dtype=np.int32)
    return np.where(cols[None, :] <= last[:, None], cols[None, :], -1).astype(np.int32)


def shared_blocks_upto(positions: np.ndarray, row=None):
    """(n,) positions -> (1, max_block + 1) int32: blocks 0..max(pos)//BLOCK as one selection
    that every query shares. Attention masks each query's cells after its position, so
    this reads what all_blocks_upto does, without an (n, max_block + 1) array: a prompt
    chunk of 2,048 queries at 8K context would build and send 4 MB of it per layer.
    row: (1, n_blocks) holding 0, 1, ... (a device array made once) to return a view of."""
    width = int(np.asarray(positions).max()) // BLOCK + 1
    return np.arange(width, dtype=np.int32).reshape(1, -1) if row is None else row[:, :width]


# --8<-- [start:select_blocks]
def select_blocks(scores: np.ndarray, positions: np.ndarray, window_blocks: int, budget_cells: int) -> np.ndarray:
    """scores (n_q, n_blocks) float32, positions (n_q,) -> (n_q, max_sel) int32 ascending, -1 padded."""
    budget_blocks = max(1, budget_cells // BLOCK)
    rows = []
    for score, pos in zip(scores, positions):
        last = int(pos) // BLOCK
        always = {0} | set(range(max(0, last - window_blocks + 1), last + 1))
        others = [b for b in np.argsort(-score[: last + 1], kind="stable") if b not in always]
        take = max(0, budget_blocks - len(always))
        rows.append(sorted(always | {int(b) for b in others[:take]}))
    out = np.full((len(rows), max(map(len, rows))), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
# --8<-- [end:select_blocks]
