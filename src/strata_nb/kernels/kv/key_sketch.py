"""The key sketch: every cell's K again, in 4 bits (q4_0), kept in VRAM for QSA to score.

QSA picks the blocks a decode query reads (kernels/step/select_blocks.py) by scoring every
block without reading its K/V, which may sit in host memory. It scores from a copy of K
small enough to stay in VRAM for the whole context: each cell's K per KV head as ggml's
q4_0 (32 values in 18 bytes, kernels/kv/quant_q4_0.py), 108 bytes a cell for the default
model's 3 heads of 64, a third of what k8v4 stores for the cell and less than half of what
it stores for K. The scorer takes q . k over these 4-bit keys, cell by cell, and a block's
score is its best cell's (kernels/step/block_scores.py).

Kept at append time, by the one writer, for every cell it writes: a prompt chunk, a decode
step, a verify window. A rejected speculative cell's sketch is written over by the next
window with the cell itself. Until then it lies past the query, in the query's own block,
which is always read and never scored.

The kernel gives each (cell, KV head, 32-value group) LANES threads. On a GPU that is a
warp, a value a lane, which quantizes the group together as the q4_0 format's append does
(`quantize_q4_0_warp`: the largest |x| by warp_max, d from that lane), and lanes 0..15
write its 16 code bytes: so the sketch's bytes equal `quantize_q4_0_ref` of the cell's K,
as the tests check. One thread walking the group's 32 values alone
(`quantize_q4_0_group`) is the plainer body, and the simulator's (LANES = 1, from
gpu/geometry.py), but a decode step on the GPU would wait for its chain of 32 loads and
compares; a warp takes them side by side. The body is a device function (`sketch_group`)
so that k8v4's append can run it in its own launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.geometry import SKETCH_LANES as LANES
from strata_nb.gpu.launch import DeviceArgs, expect, grid_for, view_bytes
from strata_nb.kernels.kv.quant_q4_0 import (D_STRIDE, HALF, quantize_q4_0_group, quantize_q4_0_ref,
                                             quantize_q4_0_warp)
from strata_nb.kv_layout import BLOCK, Q4_BYTES, Q4_GROUP


def sketch_shape(n_blocks: int, n_kv: int, head_dim: int) -> tuple:
    """A layer's sketch: (n_blocks, n_kv, BLOCK, head_dim // 32 * 18) uint8, q4_0 rows."""
    return (n_blocks, n_kv, BLOCK, head_dim // Q4_GROUP * Q4_BYTES)


# --8<-- [start:key_sketch_ref]
def key_sketch_ref(k_new,      # (n, n_kv, hd) float32 the appended K (as stored: rotated for q4_0)
                   positions,  # (n,) int32
                   sketch):    # (n_blocks, n_kv, BLOCK, hd // 32 * 18) uint8, cells written
    for i in range(len(positions)):
        b, c = positions[i] // BLOCK, positions[i] % BLOCK
        sketch[b, :, c] = quantize_q4_0_ref(k_new[i])  # each KV head's row, q4_0
# --8<-- [end:key_sketch_ref]


# --8<-- [start:key_sketch_kernel]
@cuda.jit(device=True)
def sketch_group(unit, lane, k_new, positions, sketch, sketch_d):
    # group `unit`: cell i, KV head h, 32-value group g of the head's row
    n, n_kv, hd = k_new.shape
    groups = hd // Q4_GROUP
    if LANES == 1:  # one thread walks the group's 32 values: the q4_0 format's per-thread body
        if unit < n * n_kv * groups:
            i, h, g = unit // (n_kv * groups), unit // groups % n_kv, unit % groups
            b, c = positions[i] // BLOCK, positions[i] % BLOCK
            quantize_q4_0_group(k_new[i, h], sketch[b, h, c], sketch_d[b, h, c], g)
        return
    # A warp, a value a lane. Warps past the last group redo the last one without
    # writing: warp_max needs every lane of the block.
    writes = unit < n * n_kv * groups
    unit = min(unit, n * n_kv * groups - 1)
    i, h, g = unit // (n_kv * groups), unit // groups % n_kv, unit % groups
    b, c = positions[i] // BLOCK, positions[i] % BLOCK
    byte, d = quantize_q4_0_warp(k_new[i, h, g * Q4_GROUP + lane], lane)
    if writes and lane < HALF:
        sketch[b, h, c, g * Q4_BYTES + 2 + lane] = byte
    if writes and lane == 0:
        sketch_d[b, h, c, g * D_STRIDE] = d


@cuda.jit(cache=True)
def key_sketch_kernel(k_new, positions, sketch, sketch_d):  # as key_sketch_ref; sketch_d: its bytes as float16
    t = cuda.grid(1)
    sketch_group(t // LANES, t % LANES, k_new, positions, sketch, sketch_d)
# --8<-- [end:key_sketch_kernel]


def sketch_launch(dev, k_new, positions, sketch) -> tuple[int, tuple]:
    """Check key_sketch's arguments; return its threads (LANES per cell, KV head and 32-value
    group) and the kernel's arguments, moved by `dev` (a DeviceArgs)."""
    expect("k_new", k_new, np.float32, (None, None, None))
    n, n_kv, hd = k_new.shape
    expect("positions", positions, np.int32, (n,))
    expect("sketch", sketch, np.uint8, (None, n_kv, BLOCK, hd // Q4_GROUP * Q4_BYTES))
    out = dev.write(sketch)
    return n * n_kv * (hd // Q4_GROUP) * LANES, (dev.read(k_new), dev.read(positions), out, view_bytes(out, np.float16))


def key_sketch(k_new, positions, sketch):
    """Like key_sketch_ref, on the device: the same bytes."""
    with DeviceArgs() as dev:
        threads, args = sketch_launch(dev, k_new, positions, sketch)
        if threads:
            key_sketch_kernel[grid_for(threads)](*args)
