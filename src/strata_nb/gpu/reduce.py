"""Warp reductions: the sum or the max of one float32 per lane over the 32 lanes of a warp.

Every kernel that ends in a dot product or a norm (matvec, rmsnorm, argmax) finishes with
one of these. The contract: all 32 lanes of every warp of the thread block call it at the
same point, each with its float32 value, and every lane gets the warp's result back.

Why two versions. On a GPU the lanes of a warp trade registers directly: a
`shfl_xor_sync` round hands each lane the value of the lane whose index differs in one
bit, so five rounds (offsets 16, 8, 4, 2, 1) leave the whole warp's total in every lane,
with no shared memory and no barrier. Numba's CUDA simulator runs each CUDA thread as a
Python thread and has no warp intrinsics at all, so under NUMBA_ENABLE_CUDASIM=1 the
lanes trade through shared memory instead: each writes its value, one barrier, then each
lane replays the same five rounds on its warp's 32 values and keeps the result (a
barrier wakes every simulated thread in turn, so there is just the one). The
replay adds in the order the shuffles do (lane j + lane j^16, then those pairwise, ...),
so both versions return the same bits: a kernel's result under the simulator is the
result it gives on the GPU. The fallback's barrier is block-wide, which is why the
contract asks every warp of the block, not just every lane of one warp, to call it.

The same two reductions over a group of 4 lanes (lane // 4), `quad_sum` and `quad_max`,
finish a row of a tensor-core product, which lies in one group (fast/tensor_core.py).

On the GPU there are single shuffles too: `warp_xor` (the value of the lane whose index
differs in the given bits) and `warp_take` (the value of a given lane), for code that
moves values between lanes itself (gpu/warp_rows.py). They have no simulator version:
there each shuffle would be a block-wide barrier, so warp_rows.py's functions have
simulator twins that trade the warp's values once through `exchange` and replay the
same steps.

The version is chosen once, at import, from `gpu.geometry.SIMULATED`.

Block-wide reductions (`block_sum`, `block_max`) are two warp steps through a shared
array of per-warp results; they need a 1-D block, `blockDim.x` a multiple of 32.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import SIMULATED

WARP = 32
MAX_THREADS = 1024  # the most threads a block can have: the simulator's scratch has a slot each
FULL_MASK = 0xFFFFFFFF  # every lane takes part in each shuffle
NEG_INF = np.float32(-np.inf)


# --8<-- [start:warp_reduce]
if not SIMULATED:
    @cuda.jit(device=True)
    def warp_sum(x):
        """x: this lane's float32 -> the sum over its warp, in every lane."""
        offset = WARP // 2
        while offset > 0:
            x += cuda.shfl_xor_sync(FULL_MASK, x, offset)  # the lane whose index differs in one bit
            offset //= 2
        return x

    @cuda.jit(device=True)
    def warp_max(x):
        """x: this lane's float32 -> the max over its warp, in every lane."""
        offset = WARP // 2
        while offset > 0:
            x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
            offset //= 2
        return x

    @cuda.jit(device=True)
    def quad_sum(x):
        """x: this lane's float32 -> the sum over its group of 4 lanes (lane // 4), in each."""
        x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
        return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)

    @cuda.jit(device=True)
    def quad_max(x):
        """x: this lane's float32 -> the max over its group of 4 lanes, in each."""
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
        return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))

    @cuda.jit(device=True)
    def warp_xor(x, offset):
        """x: this lane's float32 -> the x of lane `lane ^ offset`, in this lane."""
        return cuda.shfl_xor_sync(FULL_MASK, x, offset)

    @cuda.jit(device=True)
    def warp_take(x, src):
        """x: this lane's float32 -> the x of lane `src`, in this lane."""
        return cuda.shfl_sync(FULL_MASK, x, src)
else:
    # Under the simulator these are plain Python, run by each simulated thread: they use
    # NumPy on the shared array directly, and keep per-thread state in a thread-local,
    # marked with the CUDA thread it belongs to (.owner, its threadIdx): a Python thread
    # may play one CUDA thread after another (the tests keep their threads in a pool).
    lane_state = threading.local()  # .scratch: the block's shared array; .count: exchanges so far
    # The simulator's shared.array looks its array up in a dict and adds it when missing: two
    # threads released by one barrier can both miss and each make an array of its own, and
    # then they trade values with no one. One lock around the first ask makes the first
    # array every thread's (fast/tensor_core.py's emulation asks under it too).
    first_ask = threading.Lock()

    @cuda.jit(device=True)
    def exchange(x):
        """The simulator's stand-in for the shuffles: this warp's 32 values as a (32,)
        float32 array. Every thread of the block must call it."""
        if getattr(lane_state, "owner", None) is not cuda.threadIdx:  # this CUDA thread's first: ask once
            with first_ask:  # (shared.array walks the Python stack each call)
                lane_state.scratch = cuda.shared.array((2, MAX_THREADS), float32)  # two rows of one value per thread
            lane_state.count, lane_state.owner = 0, cuda.threadIdx
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        # Alternate between two rows, so one barrier is enough: a lane can write row r
        # again only after the next exchange's barrier, which every lane reaches only
        # after reading row r here.
        row = lane_state.count % 2
        lane_state.count += 1
        scratch = lane_state.scratch
        scratch[row, t] = x
        cuda.syncthreads()  # every lane's value is written before any lane reads its warp's
        first = t - t % WARP
        return scratch[row, first:first + WARP].copy()

    @cuda.jit(device=True)
    def warp_sum(x):
        lanes = exchange(x)
        offset = WARP // 2
        while offset > 0:  # the shuffle rounds, replayed: lane j adds lane j + offset
            lanes = lanes[:offset] + lanes[offset:2 * offset]
            offset //= 2
        return lanes[0]  # every lane's butterfly ends on these bits: a + b == b + a

    @cuda.jit(device=True)
    def warp_max(x):
        return exchange(x).max()  # max is exact: any order gives the same value

    @cuda.jit(device=True)
    def quad_sum(x):
        lanes = exchange(x)
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        group = lanes[t % WARP - t % 4:][:4]
        return (group[0] + group[1]) + (group[2] + group[3])  # the shuffles' order; a + b == b + a

    @cuda.jit(device=True)
    def quad_max(x):
        lanes = exchange(x)
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        return lanes[t % WARP - t % 4:][:4].max()
# --8<-- [end:warp_reduce]


# --8<-- [start:block_reduce]
@cuda.jit(device=True)
def block_sum(x):
    """x: this thread's float32 -> the sum over the block, in every thread."""
    per_warp = cuda.shared.array(WARP, float32)  # (warps,) each warp's sum
    lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
    total = warp_sum(x)
    if lane == 0:
        per_warp[warp] = total
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    total = warp_sum(per_warp[lane] if lane < n_warps else float32(0.0))  # every warp sums the warps' sums
    cuda.syncthreads()  # all have read per_warp before a later call overwrites it
    return total


@cuda.jit(device=True)
def block_max(x):
    """Like block_sum, for the max; lanes past the last warp contribute -inf."""
    per_warp = cuda.shared.array(WARP, float32)  # (warps,) each warp's max
    lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
    best = warp_max(x)
    if lane == 0:
        per_warp[warp] = best
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    best = warp_max(per_warp[lane] if lane < n_warps else NEG_INF)
    cuda.syncthreads()
    return best
# --8<-- [end:block_reduce]
