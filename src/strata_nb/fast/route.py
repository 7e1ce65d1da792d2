"""Plain twin: kernels/experts/route.py route_kernel. The same router, one thread block a
token, with its chain of round trips and barriers shortened: a decode step has one such
block a layer, nothing beside it, and the whole step waits for it.

- every warp norms the row itself, from the x values it loads for its dot anyway, and
  applies 1 / rms to the logit (as matvec's normed kernels do): no block-wide sum, and
  the router rows, x and the norm weights are all loaded at once, ROUND parts a round
  (the default model's row of 576 values is 72 parts: one round for every lane);
- the softmax and the top K are warp reductions in the lanes of the experts (two
  experts a lane at most), one barrier between them, where the plain kernel has three;
  each expert's lane takes one exp and one division, the plain kernel's threads 2 E;
- the residency lookups go out at the start, beside the loads, not after the choice;
- the normed row for expert_gate_up is written at the end by the warps that write no
  choice, while warp 0's lanes of the chosen experts write the choice;
- it is launched as dependent (fast/dependent_launch.py): it waits for the o matvec at
  its first instruction, but lets expert_gate_up launch only when it ends.

The ids equal the plain kernel's and the reference's; the weights are within
`weights_tolerance` of either (kernels/experts/route.py): the logits are the same sums in
another order, with the norm applied last.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from strata_nb.fast.twins import relaunch, twin_of
from strata_nb.fast.dependent_launch import wait_for_inputs, waits_for_inputs
from strata_nb.gpu.reduce import NEG_INF, WARP, warp_max, warp_sum
from strata_nb.fast.gguf_fetch import QTYPES
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, part_runs
from strata_nb.kernels.dense.rmsnorm import inv_rms
from strata_nb.kernels.experts import route as plain
from strata_nb.kernels.experts.route import MAX_EXPERTS, is_counted, write_choice

assert MAX_EXPERTS <= 2 * WARP, "warp 0's lanes hold the experts, two a lane"

# --8<-- [start:route_kernel]
ROUND = 3  # parts of a router row a lane loads before it uses one


def make_route_kernel(part, nibbles):
    """Plain twin: kernels/experts/route.py route_kernel. Every warp norms the row itself,
    so the logits wait for no block-wide sum, and the softmax and the top K are warp
    reductions."""

    @cuda.jit(device=True)
    def x_part(x, norm, t, q, xs, ns):
        """x's and the norm's 8 values at part q of a router row, into xs and ns."""
        blk, pp = q // PARTS, q % PARTS
        lo, hi = part_runs(nibbles, pp)
        lo, hi = blk * QK + lo, blk * QK + hi
        for j in range(4):
            xs[j], xs[4 + j] = x[t, lo + j], x[t, hi + j]
            ns[j], ns[4 + j] = norm[lo + j], norm[hi + j]

    @cuda.jit(device=True)
    def logit_terms(xs, ns, w, dotted, squared, acc, squares):
        """A part of a router row (w) against the same 8 values of x * norm (xs, ns), added
        to acc if dotted; those values of x squared, added to squares if squared."""
        for j in range(4):
            a, b = xs[j], xs[4 + j]
            if squared:
                squares += a * a + b * b
            if dotted:
                acc += w[j] * (a * ns[j]) + w[4 + j] * (b * ns[4 + j])
        return acc, squares

    @cuda.jit(device=True)
    def rank_of(probs, n_expert, e, prob):
        """How many experts are more probable than expert e, or as probable with a lower id."""
        rank = 0
        for o in range(n_expert):
            if probs[o] > prob or (probs[o] == prob and o < e):
                rank += 1
        return rank

    @cuda.jit(cache=True)
    def route_kernel(x, norm, eps, ra, rb, x_norm, chosen, weights, slot_of, res, at, lookups, hits,
                     last):  # as the plain kernel's
        wait_for_inputs()  # a dependent launch (fast/dependent_launch.py), which lets the
        # next kernel launch only when it ends: expert_gate_up's blocks, placed early, would
        # wait beside this one block for all of its chain (measured slower)
        t, tid = cuda.blockIdx.x, cuda.threadIdx.x
        lane, warp, n_warps = tid % WARP, tid // WARP, cuda.blockDim.x // WARP
        d, n_expert, k = x.shape[1], ra.shape[0], chosen.shape[1]
        n_parts = d // PART
        # Warp 0's lane takes experts lane and lane + 32 in step 2; their slots are looked up
        # now, in flight with everything below (no lookup after the choice)
        e0, e1 = lane, lane + WARP
        slot0 = res[at + e0] if warp == 0 and e0 < n_expert else -1
        slot1 = res[at + e1] if warp == 0 and e1 < n_expert else -1
        counted = is_counted(t, last)  # a token, not a padded prompt chunk's repeat of its last
        # 1. One logit per expert, warp w taking experts w, w + n_warps, ... The norm is applied
        # last, as matvec's normed kernels apply it: rmsnorm(x) . router = (1 / rms) ((x * norm)
        # . router), and each warp sums the squares of x from the values it loads for its
        # first expert (its lanes read every column once). So a warp's router row, x and
        # norm loads are all out at once, and no barrier stands between them and the dot.
        # Every warp sums the squares in the same order, so every warp has the same 1 / rms.
        # ROUND parts of the row a round, each into its own arrays, so all their loads (x's,
        # the norm's, the router row's) are in flight before any is used, with no branch
        # between them (a load after a branch waits for the work before it): a part past the
        # row's end reads the last part again, and is not added. A lane adds its parts in
        # the order q, q + 32, q + 64, ...
        w0 = cuda.local.array(PART, float32)
        w1 = cuda.local.array(PART, float32)
        w2 = cuda.local.array(PART, float32)
        x0 = cuda.local.array(PART, float32)
        x1 = cuda.local.array(PART, float32)
        x2 = cuda.local.array(PART, float32)
        n0 = cuda.local.array(PART, float32)
        n1 = cuda.local.array(PART, float32)
        n2 = cuda.local.array(PART, float32)
        p = cuda.shared.array(MAX_EXPERTS, float32)  # (E,) logits
        squares = float32(0.0)
        inv = float32(0.0)
        for first in range(0, n_expert, n_warps):
            e = first + warp
            acc = float32(0.0)
            for q0 in range(lane, n_parts, ROUND * WARP):
                q1, q2 = min(q0 + WARP, n_parts - 1), min(q0 + 2 * WARP, n_parts - 1)
                x_part(x, norm, t, q0, x0, n0)
                x_part(x, norm, t, q1, x1, n1)
                x_part(x, norm, t, q2, x2, n2)
                if e < n_expert:
                    part(ra, rb, e, q0 // PARTS, q0 % PARTS, w0)
                    part(ra, rb, e, q1 // PARTS, q1 % PARTS, w1)
                    part(ra, rb, e, q2 // PARTS, q2 % PARTS, w2)
                acc, squares = logit_terms(x0, n0, w0, e < n_expert, first == 0, acc, squares)
                if q0 + WARP < n_parts:
                    acc, squares = logit_terms(x1, n1, w1, e < n_expert, first == 0, acc, squares)
                if q0 + 2 * WARP < n_parts:
                    acc, squares = logit_terms(x2, n2, w2, e < n_expert, first == 0, acc, squares)
            if first == 0:
                inv = inv_rms(warp_sum(squares), d, eps)  # every warp calls it: a barrier under the simulator
            total = warp_sum(acc)
            if lane == 0 and e < n_expert:
                p[e] = total * inv
        cuda.syncthreads()  # every logit is in
        # 2. The softmax over all E and the top K, in every warp alike (each warp reduction is
        # then reached by all of them, as the simulator needs), lane l holding experts l and
        # l + 32: the max and the sum of the exps are warp reductions, so each lane takes
        # one exp and one division per expert it holds, and no barrier comes between them.
        # Warp 0 puts the probabilities in shared memory for the ranks (the one barrier).
        l0 = p[e0] if e0 < n_expert else NEG_INF
        l1 = p[e1] if e1 < n_expert else NEG_INF
        top = warp_max(max(l0, l1))
        ex0 = math.exp(l0 - top) if e0 < n_expert else float32(0.0)
        ex1 = math.exp(l1 - top) if e1 < n_expert else float32(0.0)
        total = warp_sum(ex0 + ex1)
        prob0, prob1 = ex0 / total, ex1 / total
        probs = cuda.shared.array(MAX_EXPERTS, float32)  # (E,) the probabilities
        if warp == 0:
            if e0 < n_expert:
                probs[e0] = prob0
            if e1 < n_expert:
                probs[e1] = prob1
        cuda.syncthreads()
        rank0 = rank_of(probs, n_expert, e0, prob0) if e0 < n_expert else k
        rank1 = rank_of(probs, n_expert, e1, prob1) if e1 < n_expert else k
        kept = warp_sum((prob0 if rank0 < k else float32(0.0)) + (prob1 if rank1 < k else float32(0.0)))
        # 3. The writes and the cache's counting, by warp 0's lanes of the chosen experts, in
        # parallel; meanwhile the other warps write the experts' input for expert_gate_up (a
        # strided share of the row each, from values still in L1)
        if warp == 0:
            if rank0 < k:
                write_choice(t, e0, rank0, prob0, kept, slot0, chosen, weights, slot_of, at, lookups, hits, counted)
            if rank1 < k:
                write_choice(t, e1, rank1, prob1, kept, slot1, chosen, weights, slot_of, at, lookups, hits, counted)
        else:
            j = tid - WARP
            while j < d:
                x_norm[t, j] = x[t, j] * inv * norm[j]
                j += cuda.blockDim.x - WARP

    return waits_for_inputs(route_kernel)


ROUTE_KERNELS = {qtype: make_route_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
# --8<-- [end:route_kernel]

# The plain launcher's checks, grid and arguments, launching these kernels
route = twin_of(plain.route)(relaunch(plain.route, ROUTE_KERNELS=ROUTE_KERNELS))
