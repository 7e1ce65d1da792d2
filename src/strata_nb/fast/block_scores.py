"""Plain twin: kernels/step/block_scores.py block_scores_kernel, launched as dependent
(fast/dependent_launch.py): its thread blocks are placed while the kernel before it (the
q|k|v product) still runs, and wait for it at their first instruction.

The code is the plain kernel's for the same (query heads per KV head, KV heads, head_dim),
inlined (twins.py: inline_body), and the launcher is the plain launcher's (twins.py:
relaunch), so the scores are the plain kernel's, bit for bit.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.fast.twins import inline_body, relaunch, twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.kernels.step import block_scores as plain


def make_block_scores_kernel(G, KV, D):
    """The plain kernel for G query heads per KV head, KV heads and head_dim D, launched as
    dependent."""
    body = inline_body(plain.BLOCK_SCORES_KERNELS[G, KV, D])

    @cuda.jit(cache=True)
    def block_scores_kernel(q, sketch, sketch_d, positions, window_blocks, scores):  # as the plain kernel
        """Plain twin: kernels/step/block_scores.py block_scores_kernel, launched as dependent."""
        wait_for_inputs()
        let_next_start()
        body(q, sketch, sketch_d, positions, window_blocks, scores)
    return waits_for_inputs(block_scores_kernel)


BLOCK_SCORES_KERNELS = {key: make_block_scores_kernel(*key) for key in plain.BLOCK_SCORES_KERNELS}

block_scores = twin_of(plain.block_scores)(relaunch(plain.block_scores, BLOCK_SCORES_KERNELS=BLOCK_SCORES_KERNELS))
