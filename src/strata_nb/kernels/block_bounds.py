"""Per-block, per-head min and max of K: what QSA block selection scores blocks with.

Kept at append time. A block's bounds restart when its first cell (cell 0) is written and
widen with every later cell. A rewritten cell (a rejected speculative tail) can leave a
bound wider than the cells now there; that is safe, because a bound only has to be an
upper bound.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.kernels.launch import DeviceArgs, expect, grid_for
from strata_nb.kv.formats import BLOCK


# --8<-- [start:block_bounds_ref]
def block_bounds_ref(k_new,      # (n, n_kv, hd) float32 the appended K (as stored: rotated for q4_0)
                     positions,  # (n,) int32
                     kmin,       # (n_blocks, n_kv, hd) float32, updated
                     kmax):      # (n_blocks, n_kv, hd) float32, updated
    for i in range(len(positions)):  # in order: a window may restart a block and then widen it
        b, c = positions[i] // BLOCK, positions[i] % BLOCK
        if c == 0:
            kmin[b], kmax[b] = k_new[i], k_new[i]
        else:
            kmin[b] = np.minimum(kmin[b], k_new[i])
            kmax[b] = np.maximum(kmax[b], k_new[i])
# --8<-- [end:block_bounds_ref]


# --8<-- [start:block_bounds_kernel]
@cuda.jit
def block_bounds_kernel(k_new, positions, kmin, kmax):
    lane = cuda.grid(1)  # one (head, dim): each walks the window's cells in order
    n_kv, hd = k_new.shape[1], k_new.shape[2]
    if lane < n_kv * hd:
        h, d = lane // hd, lane % hd
        for i in range(positions.shape[0]):
            b, c = positions[i] // BLOCK, positions[i] % BLOCK
            x = k_new[i, h, d]
            if c == 0:
                kmin[b, h, d] = x
                kmax[b, h, d] = x
            else:
                kmin[b, h, d] = min(kmin[b, h, d], x)
                kmax[b, h, d] = max(kmax[b, h, d], x)
# --8<-- [end:block_bounds_kernel]


def block_bounds(k_new, positions, kmin, kmax):
    expect("k_new", k_new, np.float32, (None, None, None))
    n, n_kv, hd = k_new.shape
    expect("positions", positions, np.int32, (n,))
    expect("kmin", kmin, np.float32, (None, n_kv, hd))
    expect("kmax", kmax, np.float32, (kmin.shape[0], n_kv, hd))
    with DeviceArgs() as dev:
        block_bounds_kernel[grid_for(n_kv * hd)](dev.read(k_new), dev.read(positions), dev.write(kmin),
                                                 dev.write(kmax))
