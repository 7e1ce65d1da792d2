"""KV append for unquantized pools: fp16, and fp32 (the reference cache) through the same kernel.

The one writer (docs/design.md, "The host copy and the one writer"): for each new cell i,

    block = positions[i] // 16,  cell = positions[i] % 16,  slot = page_table[block]
    VRAM pool  [slot ][head][cell] = value    only if slot >= 0 (the block is resident)
    host copy  [block][head][cell] = value    only if the host copy is present

so a resident slot never goes stale and a non-resident block loses nothing. Presence of
the host copy is tested on the K-side array alone (`host_k.shape[0] > 0`), then each lane
takes its side's array: the rule the quantized appends share, and the one a k8v4 half
must be folded for (kv_append_k8v4.py).

The value is cast to the pool's dtype (round to nearest even for fp16; nothing for fp32);
the int8/q4_0 non-finite policy does not apply: fp16 stores inf and NaN as they are.
`_ref` and the launcher take the same arguments and both write the given arrays in place.
Positions within one call are distinct.

The rule is one device function, `store_cell` (with `cell_home`, the lookup), called per
value by this kernel and by the q|k|v matvec's epilogue, which writes a decode step's
new fp16/fp32 cell in its own launch (fast/matvec_fused.py, "Appending in the epilogue").
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect_pool, expect_window, grid_for, host_or_absent
from strata_nb.kv_layout import BLOCK, pool_arrays


# --8<-- [start:kv_append_fp16_ref]
def kv_append_fp16_ref(k_new,       # (n, n_kv, head_dim) float32
                       v_new,       # (n, n_kv, head_dim) float32
                       positions,   # (n,) int32 absolute cell positions
                       page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                       k, v,        # (n_slots, n_kv, 16, head_dim) float16 or float32: the VRAM pool
                       host_k, host_v):  # (n_logical_blocks, n_kv, 16, head_dim), or size 0 = absent
    block, cell = positions // BLOCK, positions % BLOCK
    slot = page_table[block]
    resident = slot >= 0
    host_present = host_k.shape[0] > 0  # the K-side array decides for both sides
    for new, pool, host in ((k_new, k, host_k), (v_new, v, host_v)):
        # pool[slot, :, cell] pairs slot[m] with cell[m]: shape (m, n_kv, head_dim)
        pool[slot[resident], :, cell[resident]] = new[resident].astype(pool.dtype)
        if host_present:
            host[block, :, cell] = new.astype(host.dtype)
# --8<-- [end:kv_append_fp16_ref]


# --8<-- [start:kv_append_fp16_kernel]
@cuda.jit(device=True)
def cell_home(position, page_table):
    """Where the cell at `position` lives: (block, cell, slot), slot -1 = not resident."""
    block, cell = position // BLOCK, position % BLOCK
    return block, cell, page_table[block]


@cuda.jit(device=True)
def store_cell(side,        # 0: a K value, 1: a V value
               h, j,        # its KV head and element
               value,       # float32
               block, cell, slot,  # cell_home's
               k, v, host_k, host_v):
    """The one writer's device body, for one value: the VRAM slot if the block is resident,
    the host copy if there is one. The append kernel below calls it for every value, and so
    does the q|k|v matvec of a decode step, whose epilogue writes the step's new cell itself
    (fast/matvec_fused.py, "Appending in the epilogue")."""
    if slot >= 0:
        pool = k if side == 0 else v
        pool[slot, h, cell, j] = value  # the store casts float32 to the pool's dtype
    if host_k.shape[0] > 0:  # presence is tested on the K side only, for both sides
        host = host_k if side == 0 else host_v
        host[block, h, cell, j] = value


@cuda.jit(cache=True)
def kv_append_fp16_kernel(k_new, v_new,       # (n, n_kv, head_dim) float32
                          positions,          # (n,) int32
                          page_table,         # (n_logical_blocks,) int32
                          k, v,               # (n_slots, n_kv, 16, head_dim) float16/float32
                          host_k, host_v):    # (n_logical_blocks, n_kv, 16, head_dim) or (0, ...)
    # One lane per value: neighbouring threads copy neighbouring values, so a warp reads
    # and writes whole contiguous runs (coalesced). K lanes come first, then V lanes.
    n, n_kv, head_dim = k_new.shape
    per_side = n * n_kv * head_dim
    lane = cuda.grid(1)
    if lane >= 2 * per_side:
        return
    side, rest = lane // per_side, lane % per_side
    i, h, j = rest // (n_kv * head_dim), rest // head_dim % n_kv, rest % head_dim
    value = k_new[i, h, j] if side == 0 else v_new[i, h, j]
    block, cell, slot = cell_home(positions[i], page_table)
    store_cell(side, h, j, value, block, cell, slot, k, v, host_k, host_v)
# --8<-- [end:kv_append_fp16_kernel]


def expect_dest(n_kv, head_dim, k, v, host_k, host_v):
    """Check an fp16/fp32 destination (pool and host copy) for cells of n_kv heads of
    head_dim; returns host_k, host_v with absent ones as size-0 arrays."""
    fmt = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32"}.get(np.dtype(k.dtype))
    assert fmt, f"k is {k.dtype}: this kernel writes fp16 or fp32 pools"
    spec_k, spec_v = pool_arrays(fmt, head_dim)
    expect_pool("k", k, spec_k, n_kv)
    expect_pool("v", v, spec_v, n_kv)
    host_k = host_or_absent("host_k", host_k, spec_k, n_kv)
    host_v = host_or_absent("host_v", host_v, spec_v, n_kv)
    assert host_k.shape[0] == 0 or host_v.shape[0] > 0, \
        "host_k is present but host_v is absent: the V lanes would write outside host_v"
    return host_k, host_v


def kv_append_fp16(k_new, v_new, positions, page_table, k, v, host_k, host_v):
    """Like kv_append_fp16_ref, on the device; NumPy arguments are moved and written back."""
    n, n_kv, head_dim = expect_window(k_new, v_new, positions, page_table)
    host_k, host_v = expect_dest(n_kv, head_dim, k, v, host_k, host_v)
    lanes = 2 * n * n_kv * head_dim
    if lanes == 0:
        return
    with DeviceArgs() as dev:
        kv_append_fp16_kernel[grid_for(lanes)](
            dev.read(k_new), dev.read(v_new), dev.read(positions), dev.read(page_table),
            dev.write(k), dev.write(v), dev.write(host_k), dev.write(host_v))
