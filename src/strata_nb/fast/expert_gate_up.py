"""Plain twin: kernels/experts/expert_gate_up.py (expert_gate_up_kernel: a warp a gate row
and its up row). Shaped as the dense matvec is, with a miss's rows staged and the down
matrices read ahead: a thread block's loads go out in one trip, where the plain kernel's
lanes make three, each waiting for the last.

The kernel is shaped as the dense matvec is (matvec_fused.py: "rows of W per thread
block"): a thread block takes PAIRS gate rows and their up rows, matvec's ROWS rows of W,
and its threads split the D / 8 parts of those rows between them, so at the default
shapes each thread has one part of each row and all its loads are one trip to memory. In
the plain kernel a warp's lanes walk 72 parts in three rounds, each a trip the next waits
for. The threads' sums meet in warp order, so the result does not depend on timing, or on
where an expert's rows were read from. When the cache can miss, a block whose choice is a
miss stages its rows through shared memory first (fast/expert_rows.py: stage_rows). In a
decode step or a verify window the kernel also reads each chosen expert's down matrix into
L2 for expert_down, as matvec reads the next product's weights ahead, when the expert is
in a slot: a miss's down matrix is in host memory, where reading it ahead costs bus time
that expert_down does not win back (it reads those bytes over the bus again). It is launched as dependent
(fast/dependent_launch.py).

It equals the plain kernel within `gate_up_tolerance` (kernels/experts/expert_gate_up.py):
the same dots, summed in another order (each thread's parts, then the warps'), so the
same bound as against the reference holds between the two.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from strata_nb.fast.expert_rows import make_rows_dot, stage_rows, stage_words
from strata_nb.fast.twins import twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.geometry import EXPERT_GATE_UP_WARPS
from strata_nb.gpu.launch import DeviceArgs, absent, expect, inline_device, stream, view_bytes
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.fast.gguf_fetch import CODES, QTYPES, STEPS
from strata_nb.fast.matvec_fused import AHEAD, ROWS, SECTOR, SUM_WARPS
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, part_runs
from strata_nb.kernels.dense.matvec import MAX_ROWS
from strata_nb.kernels.experts import expert_gate_up as plain
from strata_nb.kernels.experts.expert_rows import expert_views


PAIRS = ROWS // 2  # gate rows (and as many up rows) a thread block takes: matvec's ROWS rows of W
STAGE_ROW_WORDS = 512  # words of a staged gate|up row (2 KiB: D up to 3,276 in Q4_1); longer: read in place


# --8<-- [start:expert_gate_up_kernel]
def make_expert_gate_up_kernel(fetch, decode, nibbles, view_a, view_b, pairs, stages):
    """Plain twin: kernels/experts/expert_gate_up.py expert_gate_up_kernel. Gate rows
    j0 .. j0 + pairs - 1 and their up rows a thread block, the D / 8 parts of those rows
    split between its threads: one trip to memory for all of a thread's loads. `stages`:
    it stages a miss's rows (a cache that can miss), else it has no staging code at all
    (every expert resident)."""
    n_rows = 2 * pairs  # a compile-time constant, so the per-thread arrays stay in registers
    rows_dot = make_rows_dot(decode, n_rows)

    @inline_device
    def gate_up_sums(a, b, e, first_g, first_u, last, x_norm, t, d, acc):
        """This thread's terms of the block's rows of matrix e of (a, b) (two views of a
        stack of expert matrices: the slot pool, the host copy or the staged rows), added
        to acc (2 pairs): gate row first_g + j into acc[j] and up row first_u + j into
        acc[pairs + j], j = 0 .. pairs - 1 (past `last`: row last again, never stored)."""
        i, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        w = cuda.local.array((n_rows, PART), float32)  # one part of each of the block's rows
        xs = cuda.local.array(PART, float32)  # the normed row's values that part multiplies
        f_raw = cuda.local.array((n_rows, PART), float32)  # each row's part as fetched: scales or values
        c_raw = cuda.local.array((n_rows, CODES), uint32)  # and codes
        a_e, b_e = a[e], b[e]  # the expert's (2F, *) matrix, two views
        q = i
        while q < d // PART:
            # A trip's loads, x's and every row's weights, with no branch between them (a
            # load after a branch waits for the work before it)
            blk, p = q // PARTS, q % PARTS
            lo, hi = part_runs(nibbles, p)
            lo, hi = blk * QK + lo, blk * QK + hi
            for v in range(4):  # 8 values of x, each used for all the block's rows
                xs[v], xs[4 + v] = x_norm[t, lo + v], x_norm[t, hi + v]
            for j in range(pairs):  # every row's bytes first, then the arithmetic (gguf_rows.py: fetch)
                g, u = first_g + min(j, last), first_u + min(j, last)
                fetch(a_e, b_e, g, blk, p, f_raw, c_raw, j)
                fetch(a_e, b_e, u, blk, p, f_raw, c_raw, pairs + j)
            rows_dot(f_raw, c_raw, w, xs, acc)
            q += n_threads

    @cuda.jit(cache=True)
    def expert_gate_up_kernel(x_norm, chosen, slot_of, at, slot_a, slot_b, host_a, host_b, h,  # as the plain kernel's
                              down_slots,       # (N, bytes) uint8: the slot pool's down matrices, flat
                              down_host,        # (L * E, bytes) uint8: the host copy's (its shape); (0, 0) = no read ahead
                              ahead_out,        # (threads of the grid,) uint32: what each read ahead, or (0,)
                              host_words,       # (L * E, 2F * row_words) uint32: the host copy as words
                              row_words):       # int32: words a row; 0 = a miss is read in place
        wait_for_inputs()
        let_next_start()  # a dependent launch: fast/dependent_launch.py
        i, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = i % WARP, i // WARP
        j0 = cuda.blockIdx.x * pairs  # gate rows j0 .., up rows F + j0 ..
        t, r = cuda.blockIdx.y // chosen.shape[1], cuda.blockIdx.y % chosen.shape[1]
        f, d = h.shape[2], x_norm.shape[1]
        last = min(pairs, f - j0) - 1  # the block's last pair
        index = at + chosen[t, r]
        slot = slot_of[t, r]  # where this expert's rows are read from: route looked it up
        # Ahead (matvec_fused.py, "Reading ahead"): the thread blocks of a hit read the first
        # byte of each 32-byte sector of the expert's down matrix in its slot, AHEAD sectors
        # a thread, so expert_down finds it in L2 (a miss's: not at all, module docstring).
        # Only for a step or a window (T <= MAX_ROWS): a prompt chunk's choices would read
        # the same experts over and over.
        g = cuda.blockIdx.x * n_threads + i
        early = cuda.local.array(AHEAD, uint32)
        reading = down_host.shape[1] > 0 and h.shape[0] <= MAX_ROWS
        n_sectors = (down_host.shape[1] + SECTOR - 1) // SECTOR
        for u in range(AHEAD):
            sector = g + u * cuda.gridDim.x * n_threads
            early[u] = uint32(0)
            if reading and sector < n_sectors and slot >= 0:
                early[u] = uint32(down_slots[slot, sector * SECTOR])
        acc = cuda.local.array(n_rows, float32)  # this thread's partial sums: gates, then ups
        for j in range(n_rows):
            acc[j] = float32(0.0)
        # A miss (slot < 0, the same for the whole block) is staged first (expert_rows.py:
        # stage_rows): the block's gate rows j0 .. and up rows F + j0 .. into shared memory,
        # read from there.
        staged = stages and slot < 0  # the staging build is launched only with rows that fit
        stage = cuda.shared.array((1, n_rows, STAGE_ROW_WORDS), uint32)  # (1, gate rows | up rows, words)
        if staged:
            stage_rows(host_words, index, j0, last + 1, row_words, stage, 0, 0)
            stage_rows(host_words, index, f + j0, last + 1, row_words, stage, 0, pairs)
            cuda.syncthreads()  # staged is the same for the whole block: a hit's blocks wait for nothing
            gate_up_sums(stage.view(view_a), stage.view(view_b), 0, 0, pairs, last, x_norm, t, d, acc)
        elif slot >= 0:  # one memory for the whole block: a branch here, not a select at every load
            gate_up_sums(slot_a, slot_b, slot, j0, f + j0, last, x_norm, t, d, acc)
        else:
            gate_up_sums(host_a, host_b, index, j0, f + j0, last, x_norm, t, d, acc)
        # The threads' sums: within each warp by shuffles, then the warps' in warp order,
        # then SwiGLU by one thread a pair
        per_warp = cuda.shared.array((SUM_WARPS, n_rows), float32)
        for j in range(n_rows):
            total = warp_sum(acc[j])  # every warp calls it: a barrier under the simulator
            if lane == 0:
                per_warp[warp, j] = total
        cuda.syncthreads()
        if i <= last:
            gate, up = float32(0.0), float32(0.0)
            for v in range(n_threads // WARP):
                gate += per_warp[v, i]
                up += per_warp[v, pairs + i]
            h[t, r, j0 + i] = gate / (float32(1.0) + math.exp(-gate)) * up
        read = uint32(0)  # the bytes read ahead are used, or the compiler would drop their loads
        for u in range(AHEAD):
            read ^= early[u]
        if ahead_out.size > 0:
            ahead_out[cuda.blockIdx.y * cuda.gridDim.x * n_threads + g] = read

    return waits_for_inputs(expert_gate_up_kernel)


EXPERT_GATE_UP_KERNELS = {(qtype, stages): make_expert_gate_up_kernel(*STEPS[qtype], nibbles, view_a, view_b, PAIRS, stages)
                          for qtype, (_, view_a, view_b, nibbles) in QTYPES.items() for stages in (False, True)}
# --8<-- [end:expert_gate_up_kernel]


@twin_of(plain.expert_gate_up)
def expert_gate_up(x_norm, chosen, slot_of, at, slots, host, qtype, h, ahead=None, ahead_out=None, stage=True,
                   warps: int | None = None):
    """As the plain launcher (kernels/experts/expert_gate_up.py), launching the fast kernel.
    warps: per thread block (default: a part of each row per thread, at most
    EXPERT_GATE_UP_WARPS; tests set it under the simulator). ahead: the down matrices
    (slots (N, D, bytes), host (L * E, D, bytes)) whose chosen experts' bytes are read into
    L2 meanwhile, those in slots; ahead_out: a uint32 array with a slot per thread of the
    grid, given the XOR of the bytes each read. stage: a miss's rows are staged through
    shared memory (False: read in place; the engine's choice when every expert is
    resident, so its kernel has no staging code)."""
    n, d, k, f = plain.check_gate_up(x_norm, chosen, slot_of, at, h)
    if n == 0 or f == 0:
        return
    warps = gate_up_warps(d) if warps is None else warps
    assert 1 <= warps <= SUM_WARPS, f"{warps} warps a block; the kernel sums at most {SUM_WARPS}"
    with DeviceArgs() as dev:
        slot_a, slot_b = expert_views("slots", dev.read(slots), qtype, 2 * f, d)
        host_a, host_b = expert_views("host", dev.read(host), qtype, 2 * f, d)
        grid = (-(-f // PAIRS), n * k)
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
            expect("ahead_out", ahead_out, np.uint32, (grid[0] * grid[1] * warps * WARP,))
            ahead_out = dev.write(ahead_out)
        words, row_words = stage_words(dev, host, STAGE_ROW_WORDS if stage else 0)
        EXPERT_GATE_UP_KERNELS[qtype, bool(row_words)][grid, warps * WARP, stream()](
            dev.read(x_norm), dev.read(chosen), dev.read(slot_of), np.int32(at), slot_a, slot_b, host_a, host_b,
            dev.write(h), down_slots, down_host, ahead_out, words, row_words)


def gate_up_warps(d: int) -> int:
    """The kernel's warps a thread block at model dim d: a part of each row per thread."""
    return min(EXPERT_GATE_UP_WARPS, -(-(d // PART) // WARP))
