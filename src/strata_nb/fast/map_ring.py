"""Plain twin: none; the host path moves the ring with SlotTable.map_ring (kv/slots.py).
This kernel does the same for a decode step replayed from a CUDA graph, which knows its
position only in device memory.

The ring holds the most recent `--kv-window` cells at `slot = block % n_ring`
(kv/slots.py). Before a write, the ring is pointed at the block the write lands in, on
each layer's two maps: the block's old slot and the slot's old block are unmapped, and the
block takes the slot: the reference and the kernel both run kv_layout.py's `point`, the
host's own step.

A decode step writes one cell. It enters a new block at the block's first cell, so there
is nothing older in that block to refill from the host copy. The host maps the first
step's block itself, refill included, before the first replay (KVCache.before_device_steps).

Every layer writes the same position, so one launch at the step's first append moves
every layer's ring: the maps are rows of one (n_layers, ...) array, a thread per layer.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.launch import DeviceArgs, expect, grid_for
from strata_nb.kv_layout import BLOCK, point


# --8<-- [start:map_ring_ref]
def map_ring_ref(q_pos,        # (1,) int32: the cell the step writes
                 page_tables,  # (n_layers, n_blocks) int32: block -> slot, -1 = not in VRAM; updated
                 slot_blocks,  # (n_layers, n_slots) int32: slot -> block, -1 = free; updated
                 n_ring):      # int: ring slots
    block = int(q_pos[0]) // BLOCK
    for page_table, slot_block in zip(page_tables, slot_blocks):  # every layer's maps
        if page_table[block] != block % n_ring:
            point(page_table, slot_block, block, block % n_ring)  # SlotTable.map_ring's own step
# --8<-- [end:map_ring_ref]


# --8<-- [start:map_ring_kernel]
point_on_device = cuda.jit(device=True)(point)  # the host's own re-pointing, compiled for the GPU


@waits_for_inputs
@cuda.jit(cache=True)
def map_ring_kernel(q_pos, page_tables, slot_blocks, n_ring):  # as map_ring_ref, a thread per layer
    wait_for_inputs()
    let_next_start()  # a dependent launch: fast/dependent_launch.py
    layer = cuda.grid(1)
    if layer < page_tables.shape[0]:
        block = q_pos[0] // BLOCK
        if page_tables[layer, block] != block % n_ring:
            point_on_device(page_tables[layer], slot_blocks[layer], block, block % n_ring)
# --8<-- [end:map_ring_kernel]


def map_ring(q_pos, page_tables, slot_blocks, n_ring: int):
    """Like map_ring_ref, on the device."""
    expect("q_pos", q_pos, np.int32, (1,))
    expect("page_tables", page_tables, np.int32, (None, None))
    expect("slot_blocks", slot_blocks, np.int32, (page_tables.shape[0], None))
    with DeviceArgs() as dev:
        map_ring_kernel[grid_for(page_tables.shape[0])](dev.read(q_pos), dev.write(page_tables),
                                                        dev.write(slot_blocks), np.int32(n_ring))
