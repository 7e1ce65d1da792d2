"""No plain twin: the plain tier reads a prompt chunk's missed experts in place, over the
bus once for each token that chose them (kernels/experts/expert_rows.py). This kernel buys
each missed expert crossing the bus once a chunk: copied into a transit slot of the slot
pool, and the chunk's lookups of it pointed there.

    for each expert e of the layer that some token of the chunk chose, and no slot holds:
        slots[transit + e] = host[layer * E + e]            (gate|up and down)
        slot_of[t, r] = transit + e   wherever chosen[t, r] == e

Index legend: T tokens, K experts a token, E experts a layer, N slots of the cache.

A decode step's miss is one token's: its rows cross the bus once, read by the expert
kernels themselves (kernels/experts/expert_rows.py). A prompt chunk's tokens choose the
same few experts over and over, and each choice's thread blocks would read its expert's
rows over the bus again: a chunk of T tokens would move its missed experts T times. So for a chunk the
engine runs this kernel between the router and the experts: each missed expert crosses
the bus once, into one of E transit slots after the cache's N (experts/cache.py), and the
expert kernels read it there as a hit. The transit slots are never in the residency
table: the next layer's chunk writes them again, and no decode step reads them.

The grid is (E, blocks an expert): each block of expert e first asks whether any token
chose it (every block scans `chosen` itself, from L2, so no block waits for another),
and whether it is a miss; if so it copies its strided share of the expert's words, loads
before stores (FETCH_LOADS words in flight a thread, as fast/expert_rows.py's
stage_rows), and the first block points the chunk's lookups at the transit slot. The bytes are the host copy's, so the
experts compute the same bits as from the host copy or a slot.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, uint32

from strata_nb.gpu.geometry import FETCH_BLOCKS, FETCH_THREADS
from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.kernels.experts.expert_rows import expect_table

FETCH_LOADS = 8  # words a thread loads before it stores any


# --8<-- [start:fetch_misses_ref]
def fetch_misses_ref(chosen,     # (T, K) int32: the chunk's choices in this layer
                     slot_of,    # (T, K) int32: route's lookups, rewritten for the misses
                     res, at,    # (L * E,) int32 residency table; this layer's first entry
                     host_gu, host_down,    # (L * E, ...) every expert's matrices: the host copy
                     slots_gu, slots_down,  # (N + E, ...) the slot pool, its last E the transit slots
                     transit):   # int: the first transit slot, N
    for e in np.unique(chosen):
        if res[at + e] < 0:
            slots_gu[transit + e], slots_down[transit + e] = host_gu[at + e], host_down[at + e]
            slot_of[chosen == e] = transit + e
# --8<-- [end:fetch_misses_ref]


# --8<-- [start:fetch_misses_kernel]
@cuda.jit(device=True)
def copy_words(src, dst, i, j, first, step):
    """Words first, first + step, ... of src[i] into dst[j], FETCH_LOADS loads out before
    their stores."""
    n = src.shape[1]
    vals = cuda.local.array(FETCH_LOADS, uint32)
    start = first
    while start < n:
        for u in range(FETCH_LOADS):  # past the end: the last word again, not stored
            vals[u] = src[i, min(start + u * step, n - 1)]
        for u in range(FETCH_LOADS):
            if start + u * step < n:
                dst[j, start + u * step] = vals[u]
        start += FETCH_LOADS * step


@cuda.jit(cache=True)
def fetch_misses_kernel(chosen, slot_of, res, at,  # as fetch_misses_ref's
                        host_gu, host_down,        # (L * E, words) uint32: the host copy's matrices as words
                        slots_gu, slots_down,      # (N + E, words) uint32: the slot pool's
                        transit):                  # int32
    e, tid = cuda.blockIdx.x, cuda.threadIdx.x
    k = chosen.shape[1]
    n = chosen.shape[0] * k
    chose = cuda.shared.array(1, int32)
    if tid == 0:
        chose[0] = 0
    cuda.syncthreads()
    for i in range(tid, n, cuda.blockDim.x):
        if chosen[i // k, i % k] == e:
            chose[0] = 1  # every writer writes 1: no race that matters
    cuda.syncthreads()
    if chose[0] == 0 or res[at + e] >= 0:  # the same for the whole block
        return
    first, step = cuda.blockIdx.y * cuda.blockDim.x + tid, cuda.gridDim.y * cuda.blockDim.x
    copy_words(host_gu, slots_gu, at + e, transit + e, first, step)
    copy_words(host_down, slots_down, at + e, transit + e, first, step)
    if cuda.blockIdx.y == 0:
        for i in range(tid, n, cuda.blockDim.x):
            if chosen[i // k, i % k] == e:
                slot_of[i // k, i % k] = transit + e
# --8<-- [end:fetch_misses_kernel]


def fetch_misses(chosen, slot_of, res, at, host_gu, host_down, slots_gu, slots_down, transit):
    """Like fetch_misses_ref, on the device: the matrices as (entries, words) uint32
    (copy_runs.py: as_words), NumPy, mapped-host or device arrays."""
    expect("chosen", chosen, np.int32, (None, None))
    expect("slot_of", slot_of, np.int32, chosen.shape)
    n_expert = slots_gu.shape[0] - transit
    expect_table(res, at, n_expert)
    for name, host, slots in (("gate_up", host_gu, slots_gu), ("down", host_down, slots_down)):
        expect(f"host {name}", host, np.uint32, (res.shape[0], None))
        expect(f"slots {name}", slots, np.uint32, (None, host.shape[1]))
    assert 0 <= transit and slots_down.shape[0] == slots_gu.shape[0], "transit slots: the last E of each pool"
    if chosen.size == 0:
        return
    with DeviceArgs() as dev:
        fetch_misses_kernel[(n_expert, FETCH_BLOCKS), FETCH_THREADS, stream()](
            dev.read(chosen), dev.write(slot_of), dev.read(res), np.int32(at), dev.read(host_gu),
            dev.read(host_down), dev.write(slots_gu), dev.write(slots_down), np.int32(transit))
