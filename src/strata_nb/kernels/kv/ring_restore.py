"""Ring restore: refill the ring's slots from the host copy after the host copy was rewritten.

After anything rewrites the host copy wholesale (a conversation restore), VRAM may hold
other bytes; the slot table is reset and the ring is refilled with the blocks
[max(0, end - n_ring), end), each into its static slot `block % n_ring`. Like every mover
it copies one run at a time, so it knows no format.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for


def ring_blocks(end_block: int, n_ring: int) -> range:
    return range(max(0, end_block - n_ring), end_block)


# --8<-- [start:ring_restore_ref]
def ring_restore_ref(host,       # (n_blocks, run_words) uint32: one run of the host copy
                     ring,       # (n_slots, run_words) uint32: the same run of the VRAM pool
                     end_block,  # blocks in use: [0, end_block)
                     n_ring):    # ring slots
    for b in ring_blocks(end_block, n_ring):
        ring[b % n_ring] = host[b]
# --8<-- [end:ring_restore_ref]


# --8<-- [start:ring_restore_kernel]
@cuda.jit(cache=True)
def ring_restore_kernel(host, ring,  # shapes as ring_restore_ref
                        first_block, n_copy,  # int: the first block restored, and how many
                        n_ring):  # int: ring slots
    lane = cuda.grid(1)  # one 4-byte word of one restored block
    words = host.shape[1]
    i, w = lane // words, lane % words
    if i < n_copy:
        b = first_block + i
        ring[b % n_ring, w] = host[b, w]
# --8<-- [end:ring_restore_kernel]


def ring_restore(host, ring, end_block, n_ring):
    """Like ring_restore_ref, on the device."""
    expect("host", host, np.uint32, (None, None))
    expect("ring", ring, np.uint32, (None, host.shape[1]))
    assert ring.shape[0] >= n_ring, f"ring has {ring.shape[0]} slots, want >= {n_ring}"
    blocks = ring_blocks(end_block, n_ring)
    if len(blocks) == 0:
        return
    with DeviceArgs() as dev:
        ring_restore_kernel[grid_for(len(blocks) * host.shape[1])](dev.read(host), dev.write(ring), blocks.start,
                                                                   len(blocks), n_ring)
