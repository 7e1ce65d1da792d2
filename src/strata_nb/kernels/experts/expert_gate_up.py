"""The chosen experts' gate|up products and SwiGLU, for each token and each of its K experts:

    h[t, r, j] = silu(gate_e[j] . x_norm[t]) * (up_e[j] . x_norm[t]),   e = chosen[t, r]

Index legend: T tokens, K experts a token, D model dim, F one expert's FFN width. An
expert's gate|up matrix is (2F, D): its F gate rows, then its F up rows, as llama.cpp's
ffn_gate_exps and ffn_up_exps hold them.

Only the chosen experts' rows are read, from the slot or the host copy
(expert_rows.py): at K of E experts a token, a step reads K/E of the layer's expert bytes.
Where is route's `slot_of[t, r]`: the router looked the expert up. When the cache can
miss, a block whose choice is a miss stages its rows through shared memory first
(expert_rows.py: stage_rows). One warp computes one
j for one (t, r): gate row j and up row j, each dotted with the token's normed row, then
SwiGLU in the epilogue (one launch, no (T, K, 2F) intermediate). The grid is
(F / warps per block, T * K). In a decode step or a verify window the kernel also reads
each chosen expert's down matrix into L2 for expert_down, as matvec reads the next
product's weights ahead, when the expert is in a slot: a miss's down matrix is in host
memory, where reading it ahead costs bus time that expert_down does not win back (it
reads those bytes over the bus again: tools/expert_miss.py, "down read ahead").

Tolerance: each dot as matvec's (`dot_tolerance`), then swiglu's 16 u. With the gate
value g and the up value u each within its bound dg, du of the reference's, the product
silu(g) u is within |silu'(g)| dg |u| + |silu(g)| du, and |silu'| <= 1.1.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from strata_nb.gpu.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.geometry import EXPERT_WARPS
from strata_nb.gpu.launch import DeviceArgs, absent, expect, inline_device, stream, view_bytes
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs
from strata_nb.kernels.dense.matvec import dot_tolerance, product_ref
from strata_nb.kernels.dense.matvec_fused import AHEAD, MAX_ROWS, SECTOR
from strata_nb.kernels.dense.swiglu import swiglu_ref
from strata_nb.kernels.experts.expert_rows import expert_views, make_expert_part, stage_rows, stage_words


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


STAGE_ROW_WORDS = 512  # words of a staged gate|up row (2 KiB: D up to 3,276 in Q4_1); longer: read in place
STAGE_ROWS = 2 * EXPERT_WARPS  # a block's gate rows, then its up rows


# --8<-- [start:expert_gate_up_kernel]
def make_expert_gate_up_kernel(part, nibbles, view_a, view_b, stages):
    """The kernel for one weight type; `stages`: it stages a miss's rows (a cache that can
    miss), else it has no staging code at all (every expert resident)."""
    expert_part = make_expert_part(part)

    @cuda.jit(device=True)
    def x_part(x_norm, t, blk, p, xs):
        """The token's normed row at the 8 values part p of block blk multiplies, into xs."""
        lo, hi = part_runs(nibbles, p)
        lo, hi = blk * QK + lo, blk * QK + hi
        for i in range(4):
            xs[i], xs[4 + i] = x_norm[t, lo + i], x_norm[t, hi + i]

    @cuda.jit(device=True)
    def part_dot(w, xs):
        """(a part of a row) . (the same 8 values of the token's normed row)"""
        acc = float32(0.0)
        for i in range(4):
            acc += w[i] * xs[i] + w[4 + i] * xs[4 + i]
        return acc

    @inline_device
    def gate_up_dots(a1, b1, a2, b2, slot, index, row_g, row_u, x_norm, t, lane, n):
        """A warp's gate and up dots with the token's normed row: rows row_g and row_u of
        an expert, read through expert_part from (a1, b1)[slot], or (a2, b2)[index] if
        slot < 0. The loads of the two rows' parts, and of x's values for them, are all out
        before any is used (see the kernel)."""
        g0 = cuda.local.array(PART, float32)
        u0 = cuda.local.array(PART, float32)
        g1 = cuda.local.array(PART, float32)
        u1 = cuda.local.array(PART, float32)
        x0 = cuda.local.array(PART, float32)
        x1 = cuda.local.array(PART, float32)
        gate, up = float32(0.0), float32(0.0)
        for q0 in range(lane, n, 2 * WARP):
            q1 = min(q0 + WARP, n - 1)
            blk0, p0, blk1, p1 = q0 // PARTS, q0 % PARTS, q1 // PARTS, q1 % PARTS
            x_part(x_norm, t, blk0, p0, x0)
            x_part(x_norm, t, blk1, p1, x1)
            expert_part(a1, b1, a2, b2, slot, index, row_g, blk0, p0, g0)
            expert_part(a1, b1, a2, b2, slot, index, row_u, blk0, p0, u0)
            expert_part(a1, b1, a2, b2, slot, index, row_g, blk1, p1, g1)
            expert_part(a1, b1, a2, b2, slot, index, row_u, blk1, p1, u1)
            gate += part_dot(g0, x0)
            up += part_dot(u0, x0)
            if q0 + WARP < n:
                gate += part_dot(g1, x1)
                up += part_dot(u1, x1)
        return gate, up

    @cuda.jit(cache=True)
    def expert_gate_up_kernel(x_norm,           # (T, D) float32
                              chosen,           # (T, K) int32
                              slot_of, at,      # (T, K) int32: route's lookups; int32: layer * E
                              slot_a, slot_b,   # (N, 2F, *) views of the slot pool
                              host_a, host_b,   # (L * E, 2F, *) views of the host copy
                              h,                # (T, K, F) float32, written
                              down_slots,       # (N, bytes) uint8: the slot pool's down matrices, flat
                              down_host,        # (L * E, bytes) uint8: the host copy's (its shape); (0, 0) = no read ahead
                              ahead_out,        # (threads of the grid,) uint32: what each read ahead, or (0,)
                              host_words,       # (L * E, 2F * row_words) uint32: the host copy as words
                              row_words):       # int32: words a row; 0 = a miss is read in place
        wait_for_inputs()
        let_next_start()  # a dependent launch: gpu/dependent_launch.py
        lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
        j = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp  # gate row j and up row F + j
        t, r = cuda.blockIdx.y // chosen.shape[1], cuda.blockIdx.y % chosen.shape[1]
        f, d = h.shape[2], x_norm.shape[1]
        index = at + chosen[t, r]
        slot = slot_of[t, r]  # where this expert's rows are read from: route looked it up
        # Ahead (matvec_fused.py, "Reading ahead"): the thread blocks of a hit read the first
        # byte of each 32-byte sector of the expert's down matrix in its slot, AHEAD sectors
        # a thread, so expert_down finds it in L2 (a miss's: not at all, module docstring).
        # Only for a step or a window (T <= MAX_ROWS): a prompt chunk's choices would read
        # the same experts over and over.
        g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        early = cuda.local.array(AHEAD, uint32)
        reading = down_host.shape[1] > 0 and h.shape[0] <= MAX_ROWS
        n_sectors = (down_host.shape[1] + SECTOR - 1) // SECTOR
        for u in range(AHEAD):
            sector = g + u * cuda.gridDim.x * cuda.blockDim.x
            early[u] = uint32(0)
            if reading and sector < n_sectors and slot >= 0:
                early[u] = uint32(down_slots[slot, sector * SECTOR])
        # Two parts of each row a round, four arrays (gate_up_dots): the gate and up rows'
        # loads of both parts, and x's values for them, are in flight before any is used. A
        # warp's time here is a chain of memory round trips; this makes it a quarter as long
        # as one load at a time. No branch stands between the loads (a load after a branch
        # waits for the work before it): a second part past the row's end reads the last
        # part again, and is not added.
        # A miss (slot < 0, the same for the whole block) is staged first (expert_rows.py:
        # stage_rows): the block's gate rows j0 .. and up rows F + j0 .. into shared memory,
        # read from there.
        n_warps = cuda.blockDim.x // WARP
        j0 = cuda.blockIdx.x * n_warps
        staged = stages and slot < 0  # the staging build is launched only with rows that fit
        stage = cuda.shared.array((1, STAGE_ROWS, STAGE_ROW_WORDS), uint32)  # (1, gate rows | up rows, words)
        if staged:
            stage_rows(host_words, index, j0, min(n_warps, f - j0), row_words, stage, 0, 0)
            stage_rows(host_words, index, f + j0, min(n_warps, f - j0), row_words, stage, 0, n_warps)
            cuda.syncthreads()  # staged is the same for the whole block: a hit's blocks wait for nothing
        gate, up = float32(0.0), float32(0.0)
        n = d // PART
        if j < f:
            if staged:
                sa, sb = stage.view(view_a), stage.view(view_b)
                gate, up = gate_up_dots(sa, sb, sa, sb, 0, 0, warp, n_warps + warp, x_norm, t, lane, n)
            else:
                gate, up = gate_up_dots(slot_a, slot_b, host_a, host_b, slot, index, j, f + j, x_norm, t, lane, n)
        gate, up = warp_sum(gate), warp_sum(up)  # every warp calls them: a barrier under the simulator
        if lane == 0 and j < f:
            h[t, r, j] = gate / (float32(1.0) + math.exp(-gate)) * up
        read = uint32(0)  # the bytes read ahead are used, or the compiler would drop their loads
        for u in range(AHEAD):
            read ^= early[u]
        if ahead_out.size > 0:
            ahead_out[cuda.blockIdx.y * cuda.gridDim.x * cuda.blockDim.x + g] = read

    return waits_for_inputs(expert_gate_up_kernel)


EXPERT_GATE_UP_KERNELS = {(qtype, stages): make_expert_gate_up_kernel(part, nibbles, view_a, view_b, stages)
                          for qtype, (part, view_a, view_b, nibbles) in QTYPES.items() for stages in (False, True)}
# --8<-- [end:expert_gate_up_kernel]


def expert_gate_up(x_norm, chosen, slot_of, at, slots, host, qtype, h, ahead=None, ahead_out=None, stage=True):
    """Like expert_gate_up_ref, on the device, with the experts as their GGUF rows: slots
    (N, 2F, bytes) and host (L * E, 2F, bytes) uint8 of type qtype (host: mapped memory
    or a device array). NumPy arguments are moved (h is written back). ahead: the down
    matrices (slots (N, D, bytes), host (L * E, D, bytes)) whose chosen experts' bytes are
    read into L2 meanwhile, those in slots; ahead_out: a uint32 array with a slot per thread of the grid,
    given the XOR of the bytes each read. stage: a miss's rows are staged through shared
    memory (False: read in place; the engine's choice when every expert is resident, so
    its kernel has no staging code)."""
    expect("x_norm", x_norm, np.float32, (None, None))
    n, d = x_norm.shape
    expect("h", h, np.float32, (n, None, None))
    k, f = h.shape[1:]
    expect("chosen", chosen, np.int32, (n, k))
    expect("slot_of", slot_of, np.int32, (n, k))
    assert at >= 0, f"layer's first entry {at} < 0"
    if n == 0 or f == 0:
        return
    with DeviceArgs() as dev:
        slot_a, slot_b = expert_views("slots", dev.read(slots), qtype, 2 * f, d)
        host_a, host_b = expert_views("host", dev.read(host), qtype, 2 * f, d)
        grid = (-(-f // EXPERT_WARPS), n * k)
        if ahead is None:
            down_slots = down_host = absent((0, 0), np.uint8)
        else:
            for a in ahead:
                expect("ahead", a, np.uint8, (None, None, None))
            # each expert's matrix as one row of bytes (a mapped host copy wrapped first: view_bytes)
            down_slots, down_host = (view_bytes(dev.read(a), np.uint8).reshape(a.shape[0], a.shape[1] * a.shape[2])
                                     for a in ahead)
        if ahead_out is None:
            ahead_out = absent((0,), np.uint32)
        else:
            expect("ahead_out", ahead_out, np.uint32, (grid[0] * grid[1] * EXPERT_WARPS * WARP,))
            ahead_out = dev.write(ahead_out)
        words, row_words = stage_words(dev, host, STAGE_ROW_WORDS if stage else 0)
        EXPERT_GATE_UP_KERNELS[qtype, bool(row_words)][grid, EXPERT_WARPS * WARP, stream()](
            dev.read(x_norm), dev.read(chosen), dev.read(slot_of), np.int32(at), slot_a, slot_b, host_a, host_b,
            dev.write(h), down_slots, down_host, ahead_out, words, row_words)
