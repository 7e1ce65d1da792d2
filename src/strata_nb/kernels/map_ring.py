"""The ring follows a replayed decode step's write, on the device.

The ring holds the most recent `--kv-window` cells at `slot = block % n_ring`
(kv/slots.py). On the host path `SlotTable.map_ring` points the ring at the block a write
lands in, before the write. A step replayed from a CUDA graph knows its position only in
device memory, so this kernel does the same re-pointing there, on the layer's two maps:
the block's old slot and the slot's old block are unmapped, and the block takes the slot:
the reference and the kernel both run kv/slots.py's `point`, the host's own step.

A decode step writes one cell. It enters a new block at the block's first cell, so there
is nothing older in that block to refill from the host copy. The host maps the first
step's block itself, refill included, before the first replay (KVCache.before_device_steps).
One thread.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.kernels.launch import DeviceArgs, expect, stream
from strata_nb.kv.formats import BLOCK
from strata_nb.kv.slots import point


# --8<-- [start:map_ring_ref]
def map_ring_ref(q_pos,       # (1,) int32: the cell the step writes
                 page_table,  # (n_blocks,) int32: block -> slot, -1 = not in VRAM; updated
                 slot_block,  # (n_slots,) int32: slot -> block, -1 = free; updated
                 n_ring):     # int: ring slots
    block = int(q_pos[0]) // BLOCK
    if page_table[block] != block % n_ring:
        point(page_table, slot_block, block, block % n_ring)  # SlotTable.map_ring's own step
# --8<-- [end:map_ring_ref]


# --8<-- [start:map_ring_kernel]
point_on_device = cuda.jit(device=True)(point)  # the host's own re-pointing, compiled for the GPU


@cuda.jit
def map_ring_kernel(q_pos, page_table, slot_block, n_ring):  # as map_ring_ref
    if cuda.grid(1) == 0:
        block = q_pos[0] // BLOCK
        if page_table[block] != block % n_ring:
            point_on_device(page_table, slot_block, block, block % n_ring)
# --8<-- [end:map_ring_kernel]


def map_ring(q_pos, page_table, slot_block, n_ring: int):
    """Like map_ring_ref, on the device."""
    expect("q_pos", q_pos, np.int32, (1,))
    expect("page_table", page_table, np.int32, (None,))
    expect("slot_block", slot_block, np.int32, (None,))
    with DeviceArgs() as dev:
        map_ring_kernel[1, 1, stream()](dev.read(q_pos), dev.write(page_table), dev.write(slot_block),
                                        np.int32(n_ring))
