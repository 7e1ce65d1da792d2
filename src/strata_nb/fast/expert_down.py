"""Plain twin: kernels/experts/expert_down.py (expert_down_kernel: a warp an output).
Shaped as the dense matvec is, with a miss's rows staged, the next product's weights read
ahead and its first weights read before it waits: a thread makes one trip for its four
rows, where a lane of the plain kernel makes three, each waiting for the last.

The kernel is shaped as the dense matvec is (matvec_fused.py: "rows of W per thread
block"): a thread block takes ROWS outputs at once and its threads split the K F terms of
those rows between them, so each thread has one or two parts per row and the loads of all
its rows are in flight together. In the plain kernel a lane walks six parts of one row in
three rounds at the default shapes, each round a trip to memory that the next waits for;
here a thread makes one trip for its four rows. Each thread's sum, then each warp's, then
the warps' in order: the result does not depend on timing, or on where an expert's rows
were read from. When the cache can miss, a block whose token chose a missed expert stages
its rows of every chosen expert through shared memory first, and reads them all there
(fast/expert_rows.py: stage_rows). It reads the next layer's q|k|v weights into L2 as
matvec's kernels do, and is launched as dependent, reading before it waits
(fast/dependent_launch.py).

Each x[t, d] has one writer, so there are no atomics. It equals the plain kernel within
`down_tolerance` (kernels/experts/expert_down.py): the same K F terms, summed in another
order (each thread's, then the warps'), so the same bound as against the reference holds
between the two.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from strata_nb.fast.expert_rows import make_expert_fetch, make_rows_dot, stage_rows, stage_words
from strata_nb.fast.twins import twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.geometry import EXPERT_DOWN_WARPS
from strata_nb.gpu.launch import DeviceArgs, inline_device, stream
from strata_nb.gpu.reduce import WARP, warp_sum
from strata_nb.fast.gguf_fetch import CODES, QTYPES, STEPS
from strata_nb.fast.matvec_fused import AHEAD, ROWS, SECTOR, SUM_WARPS, ahead_arrays
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, part_runs
from strata_nb.kernels.experts import expert_down as plain
from strata_nb.kernels.experts.expert_rows import MAX_USED, expert_views


STAGE_ROW_WORDS = 256  # words of a staged down row (1 KiB: F up to 1,638 in Q4_1); longer: read in place


# --8<-- [start:expert_down_kernel]
def make_expert_down_kernel(fetch, decode, nibbles, view_a, view_b, rows, stages):
    """Plain twin: kernels/experts/expert_down.py expert_down_kernel. `rows` outputs a
    thread block, their K F terms split between its threads (thread i: terms i,
    i + threads, ... of every row): the loads of all its rows in flight together.
    `stages`: it stages a miss's rows (a cache that can miss), else it has no staging code
    at all."""
    expert_fetch = make_expert_fetch(fetch)
    rows_dot = make_rows_dot(decode, rows)

    @inline_device
    def fetch_term(a1, b1, a2, b2, staged, slot, index, r, qe, o0, d, f_raw, c_raw):
        """Part qe of rows o0 .. of chosen expert r, fetched (gguf_rows.py: fetch) into
        f_raw, c_raw: from (a1, b1)[slot[r]], or (a2, b2)[index[r]] on a miss; staged: from
        the staged rows, (a1, b1)[r, j] for row o0 + j. A row past the last output fetches
        the last again; its sums are never stored."""
        blk, p = qe // PARTS, qe % PARTS
        s_r, i_r = (r if staged else slot[r]), (r if staged else index[r])
        for j in range(rows):
            row = min(j, d - 1 - o0) if staged else min(o0 + j, d - 1)
            expert_fetch(a1, b1, a2, b2, s_r, i_r, row, blk, p, f_raw, c_raw, j)

    @inline_device
    def down_sums(a1, b1, a2, b2, staged, slot, index, scale, h, t, o0, d, k, f, acc, f_raw, c_raw):
        """This thread's terms of the block's `rows` outputs, added to acc, its first term's
        rows already fetched into f_raw, c_raw (fetch_term, before the kernel waits)."""
        i, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        w = cuda.local.array((rows, PART), float32)  # one part of each of the block's rows
        xs = cuda.local.array(PART, float32)  # the weighted h values that part multiplies
        parts = f // PART  # parts of one expert's row
        # Term q of the K rows side by side is part q % parts of expert r = q // parts. The
        # thread's first q is divided once; later ones step r and the part without a
        # division (a 64-bit one by a runtime value is a long routine on a GPU).
        r = i // parts
        qe = i - r * parts
        while r < k:
            blk, p = qe // PARTS, qe % PARTS
            lo, hi = part_runs(nibbles, p)
            lo, hi = blk * QK + lo, blk * QK + hi
            c_r = scale[r]
            for v in range(4):  # 8 values of the expert's h row, each used for `rows` weights
                xs[v] = h[t, r, lo + v]
                xs[4 + v] = h[t, r, hi + v]
            for v in range(PART):  # weighted by the expert's share
                xs[v] = c_r * xs[v]
            rows_dot(f_raw, c_raw, w, xs, acc)
            qe += n_threads
            while qe >= parts and r < k:
                qe -= parts
                r += 1
            if r < k:  # the next term's rows, fetched with its h values before either is used
                fetch_term(a1, b1, a2, b2, staged, slot, index, r, qe, o0, d, f_raw, c_raw)

    @cuda.jit(cache=True)
    def expert_down_kernel(h, chosen, weights, slot_of, at, slot_a, slot_b, host_a, host_b, x,  # as the plain kernel's
                           ahead,      # (bytes,) uint8: the next matvec's W, flat, read into L2; size 0 = none
                           ahead_out,   # (threads of the grid,) uint32: what each thread read ahead, or (0,)
                           slot_words, host_words,  # (N | L * E, D * row_words) uint32: the slot pool, the host copy
                           row_words):  # int32: words a row; 0 = a miss is read in place
        # A dependent launch that reads before it waits (fast/dependent_launch.py, "Reading
        # before the wait"): the router, which wrote the choice, finished before
        # expert_gate_up let this kernel start, and no kernel of a step writes weights. So the
        # read ahead, the choice, the staging of a miss and the first term's weight rows go
        # out while expert_gate_up still runs; only h's loads wait. Nothing is written before.
        i, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = i % WARP, i // WARP
        o0, t = cuda.blockIdx.x * rows, cuda.blockIdx.y  # outputs o0 .. o0 + rows - 1 of token t
        f, d, k = h.shape[2], x.shape[1], chosen.shape[1]
        # Ahead, as matvec's kernels do ("Reading ahead" in matvec_fused.py): the first byte
        # of AHEAD 32-byte sectors a thread of the next layer's q|k|v, so that launch finds
        # its weights in L2. The first token's thread blocks read them; used at the end.
        g = cuda.blockIdx.x * n_threads + i
        n_sectors = (ahead.size + SECTOR - 1) // SECTOR
        early = cuda.local.array(AHEAD, uint32)
        for u in range(AHEAD):
            sector = g + u * cuda.gridDim.x * n_threads
            early[u] = uint32(ahead[sector * SECTOR]) if t == 0 and sector < n_sectors else uint32(0)
        # The token's K lookups and weights, once for the thread block, in shared memory
        index = cuda.shared.array(MAX_USED, int32)
        slot = cuda.shared.array(MAX_USED, int32)
        scale = cuda.shared.array(MAX_USED, float32)
        if i < k:
            index[i] = at + chosen[t, i]
            slot[i] = slot_of[t, i]
            scale[i] = weights[t, i]
        cuda.syncthreads()
        acc = cuda.local.array(rows, float32)  # this thread's partial sums
        per_warp = cuda.shared.array((SUM_WARPS, rows), float32)  # each warp's sums
        f_raw = cuda.local.array((rows, PART), float32)  # a term's rows as fetched: scales or values
        c_raw = cuda.local.array((rows, CODES), uint32)  # and codes
        for j in range(rows):
            acc[j] = float32(0.0)
        # If any chosen expert is a miss (the same for the whole block), the block stages its
        # rows o0 .. of every chosen expert, from the slot or the host copy (expert_rows.py:
        # stage_rows), and reads them all from shared memory: one loop, one kind of memory.
        staged = False
        if stages:  # the staging build is launched only with rows that fit
            for v in range(k):
                staged = staged or slot[v] < 0
        stage = cuda.shared.array((MAX_USED, rows, STAGE_ROW_WORDS), uint32)  # (expert, row, words)
        parts = f // PART
        r0 = min(i // parts, k - 1)  # this thread's first term (past the last: the last part, never summed)
        q0 = min(i - r0 * parts, parts - 1)
        if staged:
            for v in range(k):
                words, entry = (slot_words, slot[v]) if slot[v] >= 0 else (host_words, index[v])
                stage_rows(words, entry, o0, min(rows, d - o0), row_words, stage, v, 0)
            cuda.syncthreads()  # staged is the same for the whole block: a hit's blocks wait for nothing
            sa, sb = stage.view(view_a), stage.view(view_b)
            fetch_term(sa, sb, sa, sb, True, slot, index, r0, q0, o0, d, f_raw, c_raw)
            wait_for_inputs()  # for h
            let_next_start()  # a dependent launch: fast/dependent_launch.py
            down_sums(sa, sb, sa, sb, True, slot, index, scale, h, t, o0, d, k, f, acc, f_raw, c_raw)
        else:
            # --8<-- [start:down_reads_early]
            fetch_term(slot_a, slot_b, host_a, host_b, False, slot, index, r0, q0, o0, d, f_raw, c_raw)
            wait_for_inputs()  # for h: expert_gate_up's output
            let_next_start()
            down_sums(slot_a, slot_b, host_a, host_b, False, slot, index, scale, h, t, o0, d, k, f, acc, f_raw, c_raw)
            # --8<-- [end:down_reads_early]
        # The threads' sums: within each warp by shuffles, then the warps' in warp order
        for j in range(rows):
            total = warp_sum(acc[j])  # every warp calls it: a barrier under the simulator
            if lane == 0:
                per_warp[warp, j] = total
        cuda.syncthreads()
        if i < rows and o0 + i < d:
            total = float32(0.0)
            for v in range(n_threads // WARP):
                total += per_warp[v, i]
            x[t, o0 + i] += total
        read = uint32(0)  # the bytes read ahead are used, or the compiler would drop their loads
        for u in range(AHEAD):
            read ^= early[u]
        if t == 0 and ahead_out.size > 0:
            ahead_out[g] = read

    return waits_for_inputs(expert_down_kernel, reads_early=True)


EXPERT_DOWN_KERNELS = {(qtype, stages): make_expert_down_kernel(*STEPS[qtype], nibbles, view_a, view_b, ROWS, stages)
                       for qtype, (_, view_a, view_b, nibbles) in QTYPES.items() for stages in (False, True)}
# --8<-- [end:expert_down_kernel]


@twin_of(plain.expert_down)
def expert_down(h, chosen, weights, slot_of, at, slots, host, qtype, x, warps: int | None = None, ahead=None,
                ahead_out=None, stage: bool = True):
    """As the plain launcher (kernels/experts/expert_down.py), launching the fast kernel.
    warps: per thread block (default: a term of each row per thread, at most
    EXPERT_DOWN_WARPS; tests set it under the simulator). ahead, ahead_out: the kernel
    reads ahead as matvec does (its docstring). stage: a miss's rows are staged through
    shared memory (False: read in place; the engine's choice when every expert is
    resident, so its kernel has no staging code)."""
    n, d, k, f = plain.check_down(h, chosen, weights, slot_of, at, x)
    if n == 0 or d == 0:
        return
    warps = min(EXPERT_DOWN_WARPS, -(-k * (f // PART) // WARP)) if warps is None else warps
    assert 1 <= warps <= SUM_WARPS, f"{warps} warps a block; the kernel sums at most {SUM_WARPS}"
    with DeviceArgs() as dev:
        slot_a, slot_b = expert_views("slots", dev.read(slots), qtype, d, f)
        host_a, host_b = expert_views("host", dev.read(host), qtype, d, f)
        grid = (-(-d // ROWS), n)
        ahead, ahead_out = ahead_arrays(dev, ahead, ahead_out, grid[0] * warps * WARP)
        host_words, row_words = stage_words(dev, host, STAGE_ROW_WORDS if stage else 0)
        # a staging block copies its hits' rows too, from the slot pool (the same row length)
        slot_words = stage_words(dev, slots, STAGE_ROW_WORDS)[0] if row_words and slots.shape[0] else host_words
        EXPERT_DOWN_KERNELS[qtype, bool(row_words)][grid, warps * WARP, stream()](
            dev.read(h), dev.read(chosen), dev.read(weights), dev.read(slot_of), np.int32(at), slot_a, slot_b, host_a,
            host_b, dev.write(x), ahead, ahead_out, slot_words, host_words, row_words)
