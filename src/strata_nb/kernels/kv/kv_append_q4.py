"""KV append for q4_0 pools (and the rotated V half of k8v4): quantize each new cell, write it.

The same writer as kv_append_fp16.py (read its docstring first): VRAM slot if resident,
host copy if present, presence tested on the K-side host array (`host_k_q4`) alone. Each
warp quantizes one 32-value block_q4_0 of one head of one cell, for K or for V, with
quant_q4_0's device function (a value per lane), and writes it into each destination.

Rotation. A q4_0 side is stored Hadamard-rotated (hadamard.py). `rotate=False`: the
values arrive rotated (the q4_0 format's writer rotates K and V with the hadamard kernel
first, because QSA's key sketch wants the rotated K). `rotate=True`: the warp rotates the
64 values its block is half of itself, two values a lane, five rounds through shuffles
and one inside each lane (fwht64_lanes), and quantizes its half. The same additions in
the same order as hadamard_ref, so the same bytes, and k8v4's append needs no Hadamard
launch of its own (kv_append_k8v4.py).

k8v4 calls this with its V half FOLDED: `k_q4 = v_q4 = pool.v_q4`, `host_k_q4 =
host_v_q4 = host.v_q4`, `k_new = v_new = v`. Passed unfolded, with only `host_v_q4`
set, the K-side test finds no host copy and every host write is skipped, silently:
cells written while their block is not resident are lost (kv_append_k8v4.py).
`_ref` and the launcher take the same arguments and both write the given arrays in place.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.kernels.kv.hadamard import N as HADAMARD_N
from strata_nb.kernels.kv.hadamard import fwht64_lanes, hadamard_ref
from strata_nb.gpu.launch import (DeviceArgs, expect_pool, expect_window, grid_for, host_or_absent,
                                      view_bytes)
from strata_nb.kernels.kv.quant_q4_0 import D_STRIDE, HALF, quantize_q4_0_ref, quantize_q4_0_warp
from strata_nb.gpu.reduce import WARP
from strata_nb.kv_layout import BLOCK, Q4_BYTES, Q4_GROUP, pool_arrays

F16 = np.float16  # q4_0's d fields, read and written through a float16 view of the bytes


# --8<-- [start:kv_append_q4_ref]
def kv_append_q4_ref(k_new,       # (n, n_kv, head_dim) float32, rotated (unless rotate)
                     v_new,       # (n, n_kv, head_dim) float32, rotated (unless rotate)
                     positions,   # (n,) int32 absolute cell positions
                     page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                     k_q4, v_q4,  # VRAM pool by slot: (n_slots, n_kv, 16, head_dim // 32 * 18) uint8
                     host_k_q4, host_v_q4,  # host copy by logical block, size 0 = absent
                     rotate=False):  # True: k_new and v_new arrive unrotated, rotate them here
    if rotate:
        k_new, v_new = hadamard_ref(k_new), hadamard_ref(v_new)
    block, cell = positions // BLOCK, positions % BLOCK
    slot = page_table[block]
    resident = slot >= 0
    host_present = host_k_q4.shape[0] > 0  # the K-side array decides for both sides
    for new, pool, host in ((k_new, k_q4, host_k_q4), (v_new, v_q4, host_v_q4)):
        q4 = quantize_q4_0_ref(new)  # (n, n_kv, head_dim // 32 * 18)
        pool[slot[resident], :, cell[resident]] = q4[resident]
        if host_present:
            host[block, :, cell] = q4
# --8<-- [end:kv_append_q4_ref]


# --8<-- [start:kv_append_q4_kernel]
@cuda.jit(device=True)
def append_q4_warp(unit, lane,      # this warp's index among the launch's q4 warps, its lane
                   k_new, v_new,    # (n, n_kv, head_dim) float32
                   positions,       # (n,) int32
                   page_table,      # (n_logical_blocks,) int32
                   k_q4, k_d,       # (n_slots, n_kv, 16, head_dim // 32 * 18) uint8, and the
                   v_q4, v_d,       #   same bytes as float16 (... * 9): d of block g at [9 * g]
                   host_k_q4, host_k_d, host_v_q4, host_v_d,  # the same by logical block, or (0, ...)
                   rotate):         # rotate the head row before quantizing it (see the docstring)
    # One warp per (side, cell, head, 32-value block): a block shares one d, found by the
    # warp together (quantize_q4_0_warp); lanes 0..15 write its 16 code bytes as one
    # contiguous run, which matters most for the host copy across the bus. K warps come
    # first, then V warps. Warps past the last block redo the last one without writing:
    # warp_max needs every lane of the block.
    n, n_kv, head_dim = k_new.shape
    groups = head_dim // Q4_GROUP
    per_side = n * n_kv * groups
    writes = unit < 2 * per_side
    unit = min(unit, 2 * per_side - 1)
    side, rest = unit // per_side, unit % per_side
    i, h, g = rest // (n_kv * groups), rest // groups % n_kv, rest % groups
    block, cell = positions[i] // BLOCK, positions[i] % BLOCK
    slot = page_table[block]
    # --8<-- [start:rotate_in_lanes]
    row = k_new[i, h] if side == 0 else v_new[i, h]
    if rotate:  # the 64 values that block g is half of, two a lane, rotated in the lanes
        first = g // 2 * HADAMARD_N
        low, high = fwht64_lanes(row[first + lane], row[first + WARP + lane], lane)
        value = low if g % 2 == 0 else high
    else:
        value = row[g * Q4_GROUP + lane]
    byte, d = quantize_q4_0_warp(value, lane)
    # --8<-- [end:rotate_in_lanes]
    at = g * Q4_BYTES + 2 + lane  # code byte `lane` of block g
    if writes and slot >= 0:
        q4, q4_d = (k_q4, k_d) if side == 0 else (v_q4, v_d)
        if lane < HALF:
            q4[slot, h, cell, at] = byte
        if lane == 0:
            q4_d[slot, h, cell, g * D_STRIDE] = d
    if writes and host_k_q4.shape[0] > 0:  # presence is tested on the K side only, for both sides
        host_q4, host_d = (host_k_q4, host_k_d) if side == 0 else (host_v_q4, host_v_d)
        if lane < HALF:
            host_q4[block, h, cell, at] = byte
        if lane == 0:
            host_d[block, h, cell, g * D_STRIDE] = d


@cuda.jit(cache=True)
def kv_append_q4_kernel(k_new, v_new, positions, page_table, k_q4, k_d, v_q4, v_d,
                        host_k_q4, host_k_d, host_v_q4, host_v_d, rotate):  # append_q4_warp's arguments
    append_q4_warp(cuda.grid(1) // WARP, cuda.threadIdx.x % WARP, k_new, v_new, positions, page_table,
                   k_q4, k_d, v_q4, v_d, host_k_q4, host_k_d, host_v_q4, host_v_d, rotate)
# --8<-- [end:kv_append_q4_kernel]


def q4_launch(dev, k_new, v_new, positions, page_table, k_q4, v_q4, host_k_q4, host_v_q4,
              rotate=False) -> tuple[int, tuple]:
    """Check kv_append_q4's arguments; return its lanes (a warp per block, 0 = nothing to
    write) and the kernel's arguments, moved by `dev` (a DeviceArgs)."""
    n, n_kv, head_dim = expect_window(k_new, v_new, positions, page_table)
    spec = {a.field: a for a in pool_arrays("q4_0", head_dim)}
    expect_pool("k_q4", k_q4, spec["k_q4"], n_kv)
    expect_pool("v_q4", v_q4, spec["v_q4"], n_kv)
    host_k_q4 = host_or_absent("host_k_q4", host_k_q4, spec["k_q4"], n_kv)
    host_v_q4 = host_or_absent("host_v_q4", host_v_q4, spec["v_q4"], n_kv)
    assert not rotate or head_dim % HADAMARD_N == 0, f"head_dim {head_dim} is not a multiple of {HADAMARD_N}"
    assert host_k_q4.shape[0] == 0 or host_v_q4.shape[0] > 0, \
        "host_k_q4 is present but host_v_q4 is absent: the V lanes would write outside it"
    lanes = 2 * n * n_kv * (head_dim // Q4_GROUP) * WARP
    k_q4, v_q4 = dev.write(k_q4), dev.write(v_q4)
    host_k_q4, host_v_q4 = dev.write(host_k_q4), dev.write(host_v_q4)
    return lanes, (dev.read(k_new), dev.read(v_new), dev.read(positions), dev.read(page_table),
                   k_q4, view_bytes(k_q4, F16), v_q4, view_bytes(v_q4, F16),
                   host_k_q4, view_bytes(host_k_q4, F16), host_v_q4, view_bytes(host_v_q4, F16),
                   bool(rotate))


def kv_append_q4(k_new, v_new, positions, page_table, k_q4, v_q4, host_k_q4, host_v_q4, rotate=False):
    """Like kv_append_q4_ref, on the device; NumPy arguments are moved and written back."""
    with DeviceArgs() as dev:
        lanes, args = q4_launch(dev, k_new, v_new, positions, page_table, k_q4, v_q4, host_k_q4, host_v_q4,
                                rotate)
        if lanes:
            kv_append_q4_kernel[grid_for(lanes)](*args)
