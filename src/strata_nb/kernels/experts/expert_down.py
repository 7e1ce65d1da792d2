"""The chosen experts' down products, weighted by the router and added to the residual:

    x[t] += sum over r = 0 .. K-1 of weights[t, r] * (down_e . h[t, r]),   e = chosen[t, r]

Index legend: T tokens, K experts a token, D model dim, F one expert's FFN width. An
expert's down matrix is (D, F), as llama.cpp's ffn_down_exps holds it.

One warp computes one output d of one token as a single dot product of K F terms, row d
of each chosen expert's down matrix side by side against the token's K h rows, each term
scaled by its expert's weight. The lanes take parts across all K experts at once, so
every lane is busy even when F is small (moefy's split experts are 192 wide: 24 parts)
and the warp reduces once, not once an expert. Its grid is (D / warps per block, T). The
sum's order is each lane's parts in turn, then the warp's lanes: it does not depend on
timing, or on where an expert's rows were read from. Each x[t, d] has one writer, so
there are no atomics.

Tolerance: the kernel's sum is the dot of the concatenated weighted h rows with the
concatenated down rows, so matvec's `dot_tolerance` over K F terms bounds it (the weight
is one rounding more per term, within the bound's factor of 2 over the first-order
(n + 1) u), plus the rounding of the add to x and of the reference's own weighted sum
over K: (K + 2) u (|sum| + |x|).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from strata_nb.gpu.geometry import EXPERT_WARPS
from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs
from strata_nb.kernels.dense.matvec import dot_tolerance, product_ref
from strata_nb.kernels.experts.expert_rows import MAX_USED, expert_views, make_expert_part


# --8<-- [start:expert_down_ref]
def expert_down_ref(h,        # (T, K, F) float32: expert_gate_up's output
                    chosen,   # (T, K) int32: expert ids of this layer
                    weights,  # (T, K) float32: the router's weights
                    res,      # (L * E,) int32: expert at + e's slot, or -1
                    at,       # int: this layer's first entry, layer * E
                    slots,    # (N, D, F) float32: the slot pool's down matrices
                    host,     # (L * E, D, F) float32: every expert's, the host copy
                    x):       # (T, D) float32, added to
    t_, k = chosen.shape
    y = np.empty((t_, k, x.shape[1]), np.float32)  # (T, K, D) each expert's output
    for e in np.unique(chosen):
        tokens, place = np.nonzero(chosen == e)
        slot = res[at + e]
        down = slots[slot] if slot >= 0 else host[at + e]  # (D, F)
        y[tokens, place] = product_ref(h[tokens, place], down)
    total = np.zeros_like(x)
    for r in range(k):  # the kernel's order: most probable expert first
        total += weights[:, r, None] * y[:, r]
    x += total


def down_tolerance(h, chosen, weights, down_of, x):
    """(T, D) float64 bound on |kernel - reference| (module docstring); down_of(e) is
    expert e's (D, F) float32 matrix; x the residual after the add."""
    t_, k = chosen.shape
    bound = np.zeros(x.shape)
    for t in range(t_):
        weighted = np.concatenate([weights[t, r] * h[t, r] for r in range(k)])[None]  # (1, K F)
        rows = np.concatenate([down_of(int(chosen[t, r])) for r in range(k)], axis=1)  # (D, K F)
        bound[t] = dot_tolerance(weighted, rows)[0]
    return bound + (k + 2) * 2.0 ** -24 * 2 * np.abs(x.astype(np.float64)) + 1e-30
# --8<-- [end:expert_down_ref]


# --8<-- [start:expert_down_kernel]
def make_expert_down_kernel(part, nibbles):
    """The kernel for one type of expert row (its dequantizer `part`)."""
    expert_part = make_expert_part(part)

    @cuda.jit(device=True)
    def expert_terms(w, h, t, r, blk, p, weight):
        """weight * (part p of block blk of expert r's down row) . (the same part of its h row)"""
        lo, hi = part_runs(nibbles, p)
        lo, hi = blk * QK + lo, blk * QK + hi
        acc = float32(0.0)
        for i in range(4):
            acc += weight * (w[i] * h[t, r, lo + i] + w[4 + i] * h[t, r, hi + i])
        return acc

    @cuda.jit(cache=True)
    def expert_down_kernel(h,               # (T, K, F) float32
                           chosen,          # (T, K) int32
                           weights,         # (T, K) float32
                           slot_of, at,     # (T, K) int32: route's lookups; int32: layer * E
                           slot_a, slot_b,  # (N, D, *) views of the slot pool
                           host_a, host_b,  # (L * E, D, *) views of the host copy
                           x):              # (T, D) float32, added to
        lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
        o = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp  # the output: row o of down
        t = cuda.blockIdx.y
        f, d, k = h.shape[2], x.shape[1], chosen.shape[1]
        # The token's K lookups, once for the thread block, in shared memory
        index = cuda.shared.array(MAX_USED, int32)
        slot = cuda.shared.array(MAX_USED, int32)
        if cuda.threadIdx.x < k:
            index[cuda.threadIdx.x] = at + chosen[t, cuda.threadIdx.x]
            slot[cuda.threadIdx.x] = slot_of[t, cuda.threadIdx.x]
        cuda.syncthreads()
        # Two parts a round, each into its own array, so both loads are in flight before
        # either is used. The sum's order is still part q, then q + 32, ...
        w0 = cuda.local.array(PART, float32)
        w1 = cuda.local.array(PART, float32)
        acc = float32(0.0)
        parts = f // PART  # parts of one expert's row
        n = k * parts  # the K rows side by side
        if o < d:
            for q0 in range(lane, n, 2 * WARP):
                q1 = q0 + WARP
                r0, r1 = q0 // parts, q1 // parts
                blk0, p0 = (q0 % parts) // PARTS, (q0 % parts) % PARTS
                blk1, p1 = (q1 % parts) // PARTS, (q1 % parts) % PARTS
                expert_part(slot_a, slot_b, host_a, host_b, slot[r0], index[r0], o, blk0, p0, w0)
                if q1 < n:
                    expert_part(slot_a, slot_b, host_a, host_b, slot[r1], index[r1], o, blk1, p1, w1)
                acc += expert_terms(w0, h, t, r0, blk0, p0, weights[t, r0])
                if q1 < n:
                    acc += expert_terms(w1, h, t, r1, blk1, p1, weights[t, r1])
        total = warp_sum(acc)  # every warp calls it: a barrier under the simulator
        if lane == 0 and o < d:
            x[t, o] += total

    return expert_down_kernel


EXPERT_DOWN_KERNELS = {qtype: make_expert_down_kernel(part, nibbles)
                       for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:expert_down_kernel]


def check_down(h, chosen, weights, slot_of, at, x) -> tuple[int, int, int, int]:
    """The launcher's checks of its arguments' shapes and dtypes -> (T, D, K, F)."""
    expect("x", x, np.float32, (None, None))
    n, d = x.shape
    expect("h", h, np.float32, (n, None, None))
    k, f = h.shape[1:]
    expect("chosen", chosen, np.int32, (n, k))
    assert k <= MAX_USED, f"K = {k} experts a token; the kernel holds at most {MAX_USED}"
    expect("weights", weights, np.float32, (n, k))
    expect("slot_of", slot_of, np.int32, (n, k))
    assert at >= 0, f"layer's first entry {at} < 0"
    return n, d, k, f


def expert_down(h, chosen, weights, slot_of, at, slots, host, qtype, x):
    """Like expert_down_ref, on the device, with the experts as their GGUF rows: slots
    (N, D, bytes) and host (L * E, D, bytes) uint8 of type qtype, slot_of (T, K) int32
    route's lookups. NumPy arguments are moved (x is written back)."""
    n, d, k, f = check_down(h, chosen, weights, slot_of, at, x)
    if n == 0 or d == 0:
        return
    with DeviceArgs() as dev:
        slot_a, slot_b = expert_views("slots", dev.read(slots), qtype, d, f)
        host_a, host_b = expert_views("host", dev.read(host), qtype, d, f)
        EXPERT_DOWN_KERNELS[qtype][(-(-d // EXPERT_WARPS), n), EXPERT_WARPS * WARP, stream()](
            dev.read(h), dev.read(chosen), dev.read(weights), dev.read(slot_of), np.int32(at), slot_a, slot_b, host_a,
            host_b, dev.write(x))
