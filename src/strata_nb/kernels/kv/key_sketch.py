"""Per-block, per-head min and max of K: what QSA block selection scores blocks with.

Kept at append time. A block's bounds restart when its first cell (cell 0) is written and
widen with every later cell. A rewritten cell (a rejected speculative tail) can leave a
bound wider than the cells now there; that is safe, because a bound only has to be an
upper bound.

The kernel takes a window of consecutive positions, so its cells fall in at most
n // 16 + 2 blocks, each a run of at most 16 cells: thread block j takes the window's j-th
block, one thread per (KV head, dim), and walks that block's cells in order. The blocks
run side by side, so a 1,024-token prompt chunk walks 16 cells per thread, not 1,024.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.reduce import WARP
from strata_nb.kv_layout import BLOCK


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
@cuda.jit(device=True)
def bounds_thread(j, t, k_new, positions, kmin, kmax):
    # The window's j-th block, (KV head, dim) t: that block's cells in order, at most 16.
    n, n_kv, hd = k_new.shape
    if t < n_kv * hd:
        h, d = t // hd, t % hd
        first = positions[0]
        b = first // BLOCK + j
        for i in range(max(0, b * BLOCK - first), min(n, (b + 1) * BLOCK - first)):
            x = k_new[i, h, d]
            if positions[i] % BLOCK == 0:
                kmin[b, h, d] = x
                kmax[b, h, d] = x
            else:
                kmin[b, h, d] = min(kmin[b, h, d], x)
                kmax[b, h, d] = max(kmax[b, h, d], x)


@cuda.jit
def block_bounds_kernel(k_new, positions, kmin, kmax):  # shapes as block_bounds_ref
    # thread block j: the window's j-th block
    bounds_thread(cuda.blockIdx.x, cuda.threadIdx.x, k_new, positions, kmin, kmax)
# --8<-- [end:block_bounds_kernel]


def bounds_launch(dev, k_new, positions, kmin, kmax) -> tuple[int, int, tuple]:
    """Check block_bounds' arguments; return the window's blocks (a thread block each, at
    most n // 16 + 2), the threads one block takes (n_kv x head_dim) and the kernel's
    arguments, moved by `dev` (a DeviceArgs)."""
    expect("k_new", k_new, np.float32, (None, None, None))
    n, n_kv, hd = k_new.shape
    expect("positions", positions, np.int32, (n,))
    expect("kmin", kmin, np.float32, (None, n_kv, hd))
    expect("kmax", kmax, np.float32, (kmin.shape[0], n_kv, hd))
    if isinstance(positions, np.ndarray):
        assert (np.diff(positions) == 1).all(), "block_bounds takes a window of consecutive positions"
    return n // BLOCK + 2, n_kv * hd, (dev.read(k_new), dev.read(positions), dev.write(kmin), dev.write(kmax))


def block_bounds(k_new, positions, kmin, kmax):
    """Like block_bounds_ref, for a window of consecutive positions (every writer appends
    one run of cells: a prompt chunk, a verify window, a decode step)."""
    with DeviceArgs() as dev:
        blocks, threads, args = bounds_launch(dev, k_new, positions, kmin, kmax)
        block_bounds_kernel[blocks, -(-threads // WARP) * WARP, stream()](*args)
