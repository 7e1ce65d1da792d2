"""The blocks a replayed decode step reads, chosen on the device (the cuda backend)."""
from __future__ import annotations

import numpy as np

from ..kernels.step.block_scores import block_scores, block_scores_ref
from ..kernels.step.select_blocks import select_blocks, select_blocks_ref
from ..kv_layout import BLOCK


# --8<-- [start:step_blocks]
class StepBlocks:
    """What a replayed decode step's attention reads, kept in device memory: a graph cannot
    be handed a new block list, so the step makes its own. Fully resident and dense: every
    block, and attention skips those after the query. Otherwise: the selection kernel writes
    this step's list (QSA's picks, or every block up to the query), and the blocks not in
    VRAM are read in place from the host copy."""

    def __init__(self, be, kv):
        n = kv.n_blocks
        self.be, self.kv = be, kv
        self.dense_resident = not kv.streamed and kv.qsa_budget == 0
        width = n if kv.qsa_budget == 0 else max(max(1, kv.qsa_budget // BLOCK), kv.window_blocks + 1)
        self.blocks = be.asarray(np.arange(width, dtype=np.int32).reshape(1, width))  # (1, width) int32
        self.scores = be.zeros((1, n), np.float32)  # (1, n_blocks) QSA scores
        self.chosen = be.zeros((n,), np.int32)  # (n_blocks,) selected flags
        self.counts = be.zeros((3,), np.int64)  # lookups, not in VRAM, selections

    def select(self, L, q, pos):
        """The step's block list for layer L's query q at device position pos: (1, width) int32."""
        if self.dense_resident:
            return self.blocks
        if self.kv.qsa_budget:
            self.be.op(block_scores_ref, block_scores)(q, L.sketch, self.scores)
        self.be.op(select_blocks_ref, select_blocks)(self.scores, pos, L.page_table, self.kv.window_blocks, self.kv.qsa_budget,
                                    self.chosen, self.blocks, self.counts)
        return self.blocks
# --8<-- [end:step_blocks]
