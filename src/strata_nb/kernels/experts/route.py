"""The router of an MoE layer, on the device: the FFN's norm, one logit per expert, the
softmax, each token's top K and their renormalized weights, and the expert cache's counts.

    x_norm[t]   = rmsnorm(x[t]) * norm
    p[t, e]     = softmax over e of (router[e] . x_norm[t])
    chosen[t]   = the K experts of highest p, most probable first (ties: the lower id)
    weights[t]  = p[t, chosen[t]] / sum of those K

Index legend: T tokens, E experts (at most MAX_EXPERTS), D model dim, K experts used.

The chosen ids and weights stay in device memory, where the expert kernels read them. The
router also looks each chosen expert up in the residency table once, `slot_of[t, r]` = its
slot or -1, so the expert kernels read where its rows are without a lookup of their own.
And it counts, for the cache's policy and its statistics, each lookup of an expert and
whether it was a hit (resident in a slot): `lookups[layer * E + e]` and
`hits[layer * E + e]` only ever grow, so the host can read them between steps and take
differences (experts/cache.py).

One thread block per token, reading as the maths does: its threads norm the token's row
(as rmsnorm.py does) into shared memory, then each warp takes experts in turn and dots
the normed row with the expert's router row (as matvec's plain kernel does a row of W).
The softmax and top-K are small: every thread takes the max and the sum over the E
logits, and each expert's thread works out its rank; then K threads write the choices and
count them, in parallel.

Tolerance: the ids must equal the reference's; the weights are within `weights_tolerance`
(see there). Ids can differ only where two experts' probabilities are within the logits'
tolerance of each other, which random test weights do not produce.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from strata_nb.gpu.geometry import ROUTE_THREADS
from strata_nb.gpu.launch import DeviceArgs, absent, expect, stream
from strata_nb.gpu.reduce import WARP, block_sum, warp_sum
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_bytes, weight_views
from strata_nb.kernels.dense.matvec import dot_tolerance
from strata_nb.kernels.dense.rmsnorm import inv_rms, rmsnorm_ref
from strata_nb.kernels.experts.expert_rows import MAX_USED, expect_table
from strata_nb.kernels.experts.moe import moe_route_ref

MAX_EXPERTS = 64  # logits a thread block holds in shared memory
MAX_DIM = 8192  # D: the normed row a thread block holds in shared memory (32 KiB)
U = 2.0 ** -24  # float32 unit roundoff


# --8<-- [start:route_ref]
def route_ref(x,        # (T, D) float32: the residual stream
              norm,     # (D,) float32: the FFN's norm weight
              eps,      # float
              router,   # (E, D) float32
              x_norm,   # (T, D) float32, written: the experts' input
              chosen,   # (T, K) int32, written
              weights,  # (T, K) float32, written
              slot_of,  # (T, K) int32, written: each chosen expert's slot, or -1 (the lookup)
              res,      # (L * E,) int32: expert at + e's slot, or -1
              at,       # int: this layer's first entry, layer * E
              lookups,  # (L * E,) int32: +1 for each token that chose the expert
              hits,     # (L * E,) int32: +1 for each of those while it was resident
              last=None):  # (1,) int32: only rows 0 .. last[0] are tokens to count (a padded
                           # prompt chunk's rows after it repeat its last token); None = all
    rmsnorm_ref(x, norm, eps, x_norm)
    c, w = moe_route_ref(x_norm, router, chosen.shape[1])
    chosen[...], weights[...] = c, w
    slot_of[...] = res[at + c]
    counted = c if last is None or len(last) == 0 else c[: int(last[0]) + 1]
    entries = at + counted.ravel()  # a token chooses an expert at most once
    np.add.at(lookups, entries, 1)
    np.add.at(hits, entries[res[entries] >= 0], 1)


def weights_tolerance(x_norm, router):
    """(T, 1) float64: how far the kernel's weights may be from the reference's. A weight
    is exp(l_k - max) over a sum of K such terms; each logit l is within its dot
    tolerance dl of the reference's (matvec.py), so each exp is within a factor
    exp(2 dl) ~ 1 + 2 dl, and the ratio within 4 dl, plus 16 roundings (exp, the sums,
    the division; K <= 8) and the norm's own (D + 8) u carried through the logits."""
    dl = dot_tolerance(x_norm, router).max(axis=1, keepdims=True)
    return 4 * dl + (16 + 2 * (x_norm.shape[1] + 8)) * U
# --8<-- [end:route_ref]


# --8<-- [start:route_kernel]
@cuda.jit(device=True)
def write_choice(t, e, rank, prob, kept, slot, chosen, weights, slot_of, at, lookups, hits, counted):
    """Expert e, token t's choice `rank`, written for the expert kernels with its weight
    renormalized over the K picks (their probabilities' sum: kept), and, where row t is a
    token (`counted`, not padding), counted for the cache: a lookup, and a hit where the
    expert is in a slot (`slot` >= 0)."""
    chosen[t, rank] = e
    weights[t, rank] = prob / kept
    slot_of[t, rank] = slot
    if counted:
        cuda.atomic.add(lookups, at + e, int32(1))
        if slot >= 0:
            cuda.atomic.add(hits, at + e, int32(1))


@cuda.jit(device=True)
def is_counted(t, last):
    """Whether row t is a token the cache counts: last is (1,) int32, the last such row
    (a padded prompt chunk's), or size 0 (every row)."""
    return last.shape[0] == 0 or t <= last[0]


@cuda.jit(device=True)
def record_choice(t, r, slot, picked, picked_p, chosen, weights, slot_of, at, lookups, hits, counted):
    """Token t's choice r (of K), from the picks in rank order: write_choice with the K
    probabilities' sum added in rank order."""
    kept = float32(0.0)
    for i in range(chosen.shape[1]):
        kept += picked_p[i]
    write_choice(t, picked[r], r, picked_p[r], kept, slot, chosen, weights, slot_of, at, lookups, hits, counted)


def make_route_kernel(part, nibbles):
    """The router kernel for one type of router row (its dequantizer `part`)."""

    @cuda.jit(cache=True)
    def route_kernel(x, norm, eps,   # (T, D) float32, (D,) float32, float32
                     ra, rb,         # (E, *) two views of the router's GGUF rows
                     x_norm,         # (T, D) float32, written
                     chosen,         # (T, K) int32, written
                     weights,        # (T, K) float32, written
                     slot_of,        # (T, K) int32, written
                     res, at,        # (L * E,) int32, int32
                     lookups, hits,  # (L * E,) int32, counted
                     last):          # (1,) int32: the last row counted, or size 0: all
        t, tid = cuda.blockIdx.x, cuda.threadIdx.x
        lane, warp, n_warps = tid % WARP, tid // WARP, cuda.blockDim.x // WARP
        d, n_expert, k = x.shape[1], ra.shape[0], chosen.shape[1]
        # 1. The norm, as rmsnorm_kernel: each thread a strided share of the row. The normed
        # row is kept in shared memory too: the logits read it from there, not back from
        # global memory (each read of global memory is a round trip this one block waits for).
        row = cuda.shared.array(MAX_DIM, float32)  # (D,) the normed row
        squares = float32(0.0)
        for j in range(tid, d, cuda.blockDim.x):
            row[j] = x[t, j]
            squares += row[j] * row[j]
        inv = inv_rms(block_sum(squares), d, eps)  # block_sum's barrier: row is written
        for j in range(tid, d, cuda.blockDim.x):
            row[j] = row[j] * inv * norm[j]
            x_norm[t, j] = row[j]
        cuda.syncthreads()  # the normed row is whole before any warp reads it
        # 2. One logit per expert: warp w takes experts w, w + n_warps, ... (as matvec's plain
        # kernel takes rows of W), a lane parts lane, lane + 32, ... of the expert's router
        # row; every warp runs the same number of rounds, because warp_sum is a block-wide
        # barrier under the simulator.
        w = cuda.local.array(PART, float32)  # a part of the router row, dequantized
        p = cuda.shared.array(MAX_EXPERTS, float32)  # (E,) logits, then probabilities
        for first in range(0, n_expert, n_warps):
            e = first + warp
            acc = float32(0.0)
            if e < n_expert:
                for q in range(lane, d // PART, WARP):
                    blk, pp = q // PARTS, q % PARTS
                    part(ra, rb, e, blk, pp, w)
                    lo, hi = part_runs(nibbles, pp)
                    lo, hi = blk * QK + lo, blk * QK + hi
                    for j in range(4):
                        acc += w[j] * row[lo + j] + w[4 + j] * row[hi + j]
            total = warp_sum(acc)
            if lane == 0 and e < n_expert:
                p[e] = total
        cuda.syncthreads()
        # 3. The softmax over all E (as the reference takes its top K from) and the top K.
        # Every thread scans the E logits for the max and the sum itself (the same order,
        # so the same bits in every thread); then each expert's thread counts the experts
        # that beat it, its rank. No thread waits on another's E x K loop.
        top = p[0]
        for e in range(1, n_expert):
            top = max(top, p[e])
        total = float32(0.0)
        for e in range(n_expert):
            total += math.exp(p[e] - top)
        cuda.syncthreads()  # every thread has its max and sum before p is overwritten
        for e in range(tid, n_expert, cuda.blockDim.x):
            p[e] = math.exp(p[e] - top) / total
        cuda.syncthreads()
        picked = cuda.shared.array(MAX_USED, int32)  # (K,) the chosen ids, most probable first
        picked_p = cuda.shared.array(MAX_USED, float32)  # (K,) their probabilities
        for e in range(tid, n_expert, cuda.blockDim.x):
            rank = 0
            for o in range(n_expert):  # more probable, or as probable with a lower id
                if p[o] > p[e] or (p[o] == p[e] and o < e):
                    rank += 1
            if rank < k:
                picked[rank], picked_p[rank] = e, p[e]
        cuda.syncthreads()
        # 4. The writes and the cache's counting, one thread per chosen expert: in parallel,
        # because each is a round trip to global memory.
        if tid < k:
            record_choice(t, tid, res[at + picked[tid]], picked, picked_p, chosen, weights, slot_of, at, lookups, hits,
                          is_counted(t, last))

    return route_kernel


ROUTE_KERNELS = {qtype: make_route_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:route_kernel]


def route(x, norm, eps, raw, qtype, x_norm, chosen, weights, slot_of, res, at, lookups, hits, last=None):
    """Like route_ref, on the device, with the router as its GGUF rows: raw (E, bytes)
    uint8 of type qtype. NumPy arguments are moved (outputs written back). last: as
    route_ref's, (1,) int32 in device memory or NumPy."""
    expect("x", x, np.float32, (None, None))
    n, d = x.shape
    assert d <= MAX_DIM, f"D = {d}; the router kernel holds a row of at most {MAX_DIM}"
    expect("norm", norm, np.float32, (d,))
    expect("raw", raw, np.uint8, (None, row_bytes(qtype, d)))
    n_expert = raw.shape[0]
    assert 1 <= n_expert <= MAX_EXPERTS, f"{n_expert} experts; the router kernel holds at most {MAX_EXPERTS}"
    expect("x_norm", x_norm, np.float32, (n, d))
    expect("chosen", chosen, np.int32, (n, None))
    k = chosen.shape[1]
    assert 1 <= k <= min(n_expert, MAX_USED), f"K = {k} experts a token: 1 .. {min(n_expert, MAX_USED)}"
    expect("weights", weights, np.float32, (n, k))
    expect("slot_of", slot_of, np.int32, (n, k))
    expect_table(res, at, n_expert, lookups=lookups, hits=hits)
    if n == 0:
        return
    with DeviceArgs() as dev:
        ra, rb = weight_views(dev.read(raw), qtype)
        ROUTE_KERNELS[qtype][n, ROUTE_THREADS, stream()](
            dev.read(x), dev.read(norm), np.float32(eps), ra, rb, dev.write(x_norm), dev.write(chosen),
            dev.write(weights), dev.write(slot_of), dev.read(res), np.int32(at), dev.write(lookups), dev.write(hits),
            absent((0,), np.int32) if last is None else dev.read(last))
