"""A row of values held by one warp, one or two values a lane: the steps that trade them
between lanes, for the kernels that quantize or rotate a head row in a warp
(kernels/kv/hadamard.py: fwht64_lanes, kernels/kv/quant_q4_0.py: quantize_q4_0_warp).

On a GPU the lanes trade through shuffles (gpu/reduce.py: warp_xor, warp_take,
warp_max). The simulator has no shuffles: there each would be a block-wide barrier
(reduce.py's `exchange`), and a rotation's ten of them, for every head row of every
append, would slow the simulated engine tests badly. So each function here has a
simulator twin that trades the warp's values once through `exchange` and replays the
GPU version's steps on them, in the same order: the same bits.

The version is chosen once, at import, from `gpu.geometry.SIMULATED`. Every lane of the
warp calls these together; under the simulator, every thread of the block.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import SIMULATED
from strata_nb.gpu.reduce import WARP

LOG_WARP = 5  # WARP = 2 ** LOG_WARP
HALF_WARP = WARP // 2

if not SIMULATED:
    from strata_nb.gpu.reduce import warp_max, warp_take, warp_xor

    @cuda.jit(device=True)
    def lane_butterflies(a, b, lane):
        """Rounds h = 1, 2, ..., 16 of a fast Walsh-Hadamard transform of the warp's
        64-value row, two values a lane: a = row[lane], b = row[lane + 32]. Round h pairs
        values in lanes whose index differs in bit h, so a shuffle (warp_xor) brings the
        partner's value; the lane that holds the pair's lower index keeps a + b, the other
        a - b (partner minus own). Returns the lane's two values after the five rounds."""
        for lg in range(LOG_WARP):
            h = 1 << lg
            pa = warp_xor(a, h)
            pb = warp_xor(b, h)
            if lane & h:  # this lane holds j + h: the pair's second value
                a, b = pa - a, pb - b
            else:
                a, b = a + pa, b + pb
        return a, b

    @cuda.jit(device=True)
    def largest_and_across(v, lane):
        """v: this lane's value of the warp's 32 -> the value of largest |v| (that of the
        first lane that has it, as argmax keeps the first of equals: the lowest such lane
        is a max over -lane; taken from that lane, so a -0.0 keeps its sign), and the value
        of lane (lane + 16) % 32."""
        largest = warp_max(abs(v))
        first = int(-warp_max(float32(-lane) if abs(v) == largest else float32(-WARP)))
        return warp_take(v, first), warp_take(v, (lane + HALF_WARP) % WARP)

else:
    from strata_nb.gpu.reduce import exchange

    LANE = np.arange(WARP)

    @cuda.jit(device=True)
    def lane_butterflies(a, b, lane):
        """The five rounds on the warp's two exchanged rows, every lane's at once."""
        row_a, row_b = exchange(a), exchange(b)
        for lg in range(LOG_WARP):
            h = 1 << lg
            pa, pb = row_a[LANE ^ h], row_b[LANE ^ h]
            second = (LANE & h) != 0
            row_a = np.where(second, pa - row_a, row_a + pa)
            row_b = np.where(second, pb - row_b, row_b + pb)
        return row_a[lane], row_b[lane]

    @cuda.jit(device=True)
    def largest_and_across(v, lane):
        values = exchange(v)  # (32,) the warp's values
        return values[int(np.argmax(np.abs(values)))], values[(lane + HALF_WARP) % WARP]
