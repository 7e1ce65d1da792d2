"""The chosen experts' gate|up products and SwiGLU, for each token and each of its K experts:

    h[t, r, j] = silu(gate_e[j] . x_norm[t]) * (up_e[j] . x_norm[t]),   e = chosen[t, r]

Index legend: T tokens, K experts a token, D model dim, F one expert's FFN width. An
expert's gate|up matrix is (2F, D): its F gate rows, then its F up rows, as llama.cpp's
ffn_gate_exps and ffn_up_exps hold them.

Only the chosen experts' rows are read, from the slot or the host copy
(expert_rows.py): at K of E experts a token, a step reads K/E of the layer's expert bytes.
Where is route's `slot_of[t, r]`: the router looked the expert up.

One warp computes one h[t, r, j]: gate row j and up row F + j of the expert each dotted
with the token's normed row, then SwiGLU in the epilogue (one launch, no (T, K, 2F)
intermediate). Its grid is (F / warps per block, T * K). The sum's order is each lane's
parts in turn, then the warp's lanes: it does not depend on timing, or on where an
expert's rows were read from.

Tolerance: each dot as matvec's (`dot_tolerance`), then swiglu's 16 u. With the gate
value g and the up value u each within its bound dg, du of the reference's, the product
silu(g) u is within |silu'(g)| dg |u| + |silu(g)| du, and |silu'| <= 1.1.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import EXPERT_WARPS
from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs
from strata_nb.kernels.dense.matvec import dot_tolerance, product_ref
from strata_nb.kernels.dense.swiglu import swiglu_ref
from strata_nb.kernels.experts.expert_rows import expert_views, make_expert_part


# --8<-- [start:expert_gate_up_ref]
def expert_gate_up_ref(x_norm,   # (T, D) float32
                       chosen,   # (T, K) int32: expert ids of this layer
                       res,      # (L * E,) int32: expert at + e's slot, or -1
                       at,       # int: this layer's first entry, layer * E
                       slots,    # (N, 2F, D) float32: the slot pool's gate|up matrices
                       host,     # (L * E, 2F, D) float32: every expert's, the host copy
                       h):       # (T, K, F) float32, written
    """Each expert once, over the tokens that chose it (the gather), read from its slot
    when it has one: the same values as from the host copy."""
    for e in np.unique(chosen):
        tokens, place = np.nonzero(chosen == e)  # (T_e,) each
        slot = res[at + e]
        gate_up = slots[slot] if slot >= 0 else host[at + e]  # (2F, D)
        out = np.empty((len(tokens), h.shape[2]), np.float32)
        swiglu_ref(product_ref(x_norm[tokens], gate_up), out)
        h[tokens, place] = out


def gate_up_tolerance(x_norm, chosen, gate_up_of):
    """(T, K, F) float64 bound on |kernel - reference| (module docstring); gate_up_of(e)
    is expert e's (2F, D) float32 matrix."""
    t_, k = chosen.shape
    f = gate_up_of(int(chosen[0, 0])).shape[0] // 2
    bound = np.empty((t_, k, f))
    for t in range(t_):
        for r in range(k):
            w = gate_up_of(int(chosen[t, r]))
            y = (x_norm[t:t + 1].astype(np.float64) @ w.T.astype(np.float64))[0]
            dy = dot_tolerance(x_norm[t:t + 1], w)[0]
            g, u, dg, du = y[:f], y[f:], dy[:f], dy[f:]
            silu = np.abs(g / (1 + np.exp(-g)))
            bound[t, r] = 1.1 * dg * (np.abs(u) + du) + silu * du + 16 * 2.0 ** -24 * silu * np.abs(u) + 1e-30
    return bound
# --8<-- [end:expert_gate_up_ref]


# --8<-- [start:expert_gate_up_kernel]
def make_expert_gate_up_kernel(part, nibbles):
    """The kernel for one type of expert row (its dequantizer `part`)."""
    expert_part = make_expert_part(part)

    @cuda.jit(cache=True)
    def expert_gate_up_kernel(x_norm,           # (T, D) float32
                              chosen,           # (T, K) int32
                              slot_of, at,      # (T, K) int32: route's lookups; int32: layer * E
                              slot_a, slot_b,   # (N, 2F, *) views of the slot pool
                              host_a, host_b,   # (L * E, 2F, *) views of the host copy
                              h):               # (T, K, F) float32, written
        lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
        j = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp  # gate row j and up row F + j
        t, r = cuda.blockIdx.y // chosen.shape[1], cuda.blockIdx.y % chosen.shape[1]
        f, d = h.shape[2], x_norm.shape[1]
        index = at + chosen[t, r]  # the expert's entry in the host copy
        slot = slot_of[t, r]  # and its slot, or -1: route looked it up
        g = cuda.local.array(PART, float32)
        u = cuda.local.array(PART, float32)
        gate, up = float32(0.0), float32(0.0)
        if j < f:
            for q in range(lane, d // PART, WARP):  # lane by lane along the two rows' parts
                blk, p = q // PARTS, q % PARTS
                lo, hi = part_runs(nibbles, p)
                lo, hi = blk * QK + lo, blk * QK + hi
                expert_part(slot_a, slot_b, host_a, host_b, slot, index, j, blk, p, g)
                expert_part(slot_a, slot_b, host_a, host_b, slot, index, f + j, blk, p, u)
                for i in range(4):
                    gate += g[i] * x_norm[t, lo + i] + g[4 + i] * x_norm[t, hi + i]
                    up += u[i] * x_norm[t, lo + i] + u[4 + i] * x_norm[t, hi + i]
        gate, up = warp_sum(gate), warp_sum(up)  # every warp calls them: a barrier under the simulator
        if lane == 0 and j < f:
            h[t, r, j] = gate / (float32(1.0) + math.exp(-gate)) * up  # SwiGLU, swiglu_kernel's expression

    return expert_gate_up_kernel


EXPERT_GATE_UP_KERNELS = {qtype: make_expert_gate_up_kernel(part, nibbles)
                          for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:expert_gate_up_kernel]


def check_gate_up(x_norm, chosen, slot_of, at, h) -> tuple[int, int, int, int]:
    """The launcher's checks of its arguments' shapes and dtypes -> (T, D, K, F)."""
    expect("x_norm", x_norm, np.float32, (None, None))
    n, d = x_norm.shape
    expect("h", h, np.float32, (n, None, None))
    k, f = h.shape[1:]
    expect("chosen", chosen, np.int32, (n, k))
    expect("slot_of", slot_of, np.int32, (n, k))
    assert at >= 0, f"layer's first entry {at} < 0"
    return n, d, k, f


def expert_gate_up(x_norm, chosen, slot_of, at, slots, host, qtype, h):
    """Like expert_gate_up_ref, on the device, with the experts as their GGUF rows: slots
    (N, 2F, bytes) and host (L * E, 2F, bytes) uint8 of type qtype (host: mapped memory
    or a device array), slot_of (T, K) int32 route's lookups. NumPy arguments are moved
    (h is written back)."""
    n, d, k, f = check_gate_up(x_norm, chosen, slot_of, at, h)
    if n == 0 or f == 0:
        return
    with DeviceArgs() as dev:
        slot_a, slot_b = expert_views("slots", dev.read(slots), qtype, 2 * f, d)
        host_a, host_b = expert_views("host", dev.read(host), qtype, 2 * f, d)
        EXPERT_GATE_UP_KERNELS[qtype][(-(-f // EXPERT_WARPS), n * k), EXPERT_WARPS * WARP, stream()](
            dev.read(x_norm), dev.read(chosen), dev.read(slot_of), np.int32(at), slot_a, slot_b, host_a, host_b,
            dev.write(h))
