"""A lane's value plus the value of the lane half a warp away (lane ^ 16).

QSA's block scores (kernels/step/block_scores.py) give a cell's row to two lanes, l and
l ^ 16, each taking half of its q4_0 groups; this adds the two halves. On a GPU it is one
shuffle (gpu/reduce.py: warp_xor). The simulator has no shuffles: there the warp trades
its values once through shared memory (reduce.py: exchange), and a + b == b + a, so the
bits are the GPU's. Like reduce.py, the version is chosen once, at import.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.gpu.geometry import SIMULATED
from strata_nb.gpu.reduce import WARP

HALF_WARP = WARP // 2

if SIMULATED:
    from strata_nb.gpu.reduce import exchange

    @cuda.jit(device=True)
    def add_half_warp(x, lane):
        """x plus lane (lane ^ 16)'s x. Every thread of the block must call it."""
        return x + exchange(x)[lane ^ HALF_WARP]
else:
    from strata_nb.gpu.reduce import warp_xor

    @cuda.jit(device=True)
    def add_half_warp(x, lane):
        """x plus lane (lane ^ 16)'s x. Every lane of the warp must call it."""
        return x + warp_xor(x, HALF_WARP)
