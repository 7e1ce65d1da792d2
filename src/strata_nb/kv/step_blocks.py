"""The blocks a replayed decode step reads, chosen on the device (the cuda backend)."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..fast.attention_step import two_per_sm_columns
from ..kernels.step.block_scores import block_scores, block_scores_ref
from ..fast.select_blocks import select_blocks, select_blocks_ref
from ..kv_layout import BLOCK
from ..settings import MAX_WINDOW


# --8<-- [start:step_blocks]
class StepBlocks:
    """What a replayed decode step's (or verify window's) attention reads, kept in device
    memory: a graph cannot be handed a new block list, so the step makes its own, a row
    per query. Fully resident and dense: every block, and attention skips those after each
    query. Otherwise: the selection kernel writes each query's list (QSA's picks, or every
    block up to the query), and the blocks not in VRAM are read in place from the host
    copy. A window's queries select one by one, each as a decode step at its position
    would, so a verified token sees the blocks the one-token path gives it.

    Fully resident and dense, a decode step early in the context may read a narrower list:
    its first `two_per_sm_columns` blocks, whose splits fit the step attention two thread
    blocks to an SM (fast/attention_step.py: the build with more registers,
    faster while one wave holds them). The decode step keeps a graph for each width it
    uses (`width_for`, `narrowed`)."""

    def __init__(self, be, kv):
        n = kv.n_blocks
        self.be, self.kv = be, kv
        self.dense_resident = not kv.streamed and kv.qsa_budget == 0
        width = n if kv.qsa_budget == 0 else max(max(1, kv.qsa_budget // BLOCK), kv.window_blocks + 1)
        rows = np.tile(np.arange(width, dtype=np.int32), (MAX_WINDOW, 1))
        self.blocks = be.asarray(rows)  # (MAX_WINDOW, width) int32: query i's list in row i
        self.scores = be.zeros((MAX_WINDOW, n), np.float32)  # (MAX_WINDOW, n_blocks) QSA scores
        self.chosen = be.zeros((n,), np.int32)  # (n_blocks,) selected flags
        self.counts = be.zeros((3,), np.int64)  # lookups, not in VRAM, selections
        narrow = two_per_sm_columns(kv.cfg.n_kv_heads, kv.cfg.head_dim) if self.dense_resident else 0
        self.narrow = narrow if 0 < narrow < width else None  # the narrow list's columns, if any
        self.columns = width  # what select hands out now (`narrowed`)

    # --8<-- [start:width_for]
    def width_for(self, pos: int) -> int:
        """The columns a one-query step at `pos` reads: the narrow list while the query's
        block is in it, else the whole list."""
        if self.narrow is not None and pos // BLOCK < self.narrow:
            return self.narrow
        return self.blocks.shape[1]

    @contextmanager
    def narrowed(self, columns: int):
        """Within it, `select` hands out lists `columns` wide (a dense resident step's)."""
        self.columns = columns
        try:
            yield
        finally:
            self.columns = self.blocks.shape[1]
    # --8<-- [end:width_for]

    def select(self, L, q, pos):
        """The block lists for layer L's queries q (n, ...) at device positions pos (n,):
        (n, width) int32, a row per query (the step attention kernel reads a row each)."""
        n = q.shape[0]
        assert n <= MAX_WINDOW, f"{n} queries: a replayed pass holds at most {MAX_WINDOW}"
        if self.dense_resident:
            return self.blocks[:n, :self.columns]
        if self.kv.qsa_budget:
            self.be.op(block_scores_ref, block_scores)(q, L.sketch, pos, self.kv.window_blocks, self.scores[:n])
        for i in range(n):
            self.be.op(select_blocks_ref, select_blocks)(
                self.scores[i:i + 1], pos[i:i + 1], L.page_table, self.kv.window_blocks, self.kv.qsa_budget,
                self.chosen, self.blocks[i:i + 1], self.counts)
        return self.blocks[:n]
# --8<-- [end:step_blocks]
