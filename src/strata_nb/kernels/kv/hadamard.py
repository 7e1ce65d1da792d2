"""The 64-point fast Walsh-Hadamard transform, applied to every 64 consecutive values.

q4_0 keeps one scale per 32 values, so a single outlier in a head row costs its 31
neighbours their precision. Multiplying the row by an orthonormal Hadamard matrix H
spreads every value over all 64 outputs first. H / 8 is orthonormal and symmetric, so
it is its own inverse and keeps dot products: <Hq, Hk> = <q, k>, which is why rotating
K and Q leaves attention scores unchanged, and why a rotated V needs one H on the
attention output to come back (docs/design.md, "KV cells, blocks, formats").

The fast transform is 6 rounds of butterflies (a, b) -> (a + b, a - b) instead of a
64 x 64 matrix product: 6 * 64 additions instead of 64 * 64 multiply-adds. The kernel
and the reference do the same additions in the same order, so they agree bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, device_empty, grid_for, is_host_numpy
from strata_nb.gpu.warp_rows import lane_butterflies

N = 64  # values per transform: one head row of the default model
SCALE = np.float32(1 / 8)  # 1 / sqrt(64): makes H orthonormal; a power of two, so exact


# --8<-- [start:hadamard_ref]
def hadamard_ref(x):
    """x: (..., 64k) float32 -> the same shape, each consecutive 64 values transformed."""
    assert x.shape[-1] % N == 0, f"last axis {x.shape[-1]} is not a multiple of {N}"
    rows = np.asarray(x, dtype=np.float32).reshape(-1, N)  # (rows, 64)
    h = 1
    while h < N:
        # Split each run of 2h values into its halves a and b; the butterfly pairs
        # value j of a with value j of b.
        pairs = rows.reshape(-1, N // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        rows = np.stack([a + b, a - b], axis=2).reshape(-1, N)
        h *= 2
    return (rows * SCALE).reshape(x.shape)
# --8<-- [end:hadamard_ref]


# --8<-- [start:fwht64]
@cuda.jit(device=True)
def fwht64(row):
    """Transform row in place: row is (64,) float32 in local or shared memory.

    One thread does all 6 rounds; a kernel that rotates a head row before quantizing
    it calls this on the row it already holds.
    """
    h = 1
    while h < N:
        for start in range(0, N, 2 * h):
            for j in range(start, start + h):
                a = row[j]
                b = row[j + h]
                row[j] = a + b
                row[j + h] = a - b
        h *= 2
    for j in range(N):
        row[j] = row[j] * SCALE


@cuda.jit(device=True)
def fwht64_lanes(a, b, lane):
    """A 64-value row held by one warp, two values a lane: a = row[lane], b = row[lane + 32]
    -> the same two entries of the transformed row. Every lane of the warp calls it
    together. Rounds h = 1..16 pair values in different lanes (gpu/warp_rows.py trades
    them); round h = 32 pairs each lane's own two values. fwht64's additions in its
    order: the same bits."""
    a, b = lane_butterflies(a, b, lane)
    a, b = a + b, a - b
    return a * SCALE, b * SCALE
# --8<-- [end:fwht64]


# --8<-- [start:hadamard_kernel]
@cuda.jit(cache=True)
def hadamard_kernel(x,    # (rows, 64) float32
                    out):  # (rows, 64) float32, written
    r = cuda.grid(1)  # one thread per row: the transform mixes all 64 values of its row
    if r < x.shape[0]:
        row = cuda.local.array(N, float32)  # registers/local memory: private to the thread
        for j in range(N):
            row[j] = x[r, j]
        fwht64(row)
        for j in range(N):
            out[r, j] = row[j]
# --8<-- [end:hadamard_kernel]


def hadamard(x, out=None):
    """Like hadamard_ref. x: (..., 64k) float32, NumPy or device; returns the same kind,
    or writes `out` (x's shape) when given."""
    *_, width = x.shape  # not x.shape[-1]: the simulator's device shapes refuse index -1
    assert x.dtype == np.float32, f"x is {x.dtype}, want float32"
    assert width % N == 0, f"last axis {width} is not a multiple of {N}"
    n_rows = x.size // N
    if out is None:
        out = np.empty(x.shape, np.float32) if is_host_numpy(x) else device_empty(x.shape, np.float32)
    assert out.shape == x.shape and out.dtype == np.float32, f"out is {out.shape} {out.dtype}, want {x.shape} float32"
    if n_rows == 0:
        return out
    with DeviceArgs() as dev:
        rows_in = dev.read(x).reshape(n_rows, N)
        rows_out = dev.write(out).reshape(n_rows, N)
        hadamard_kernel[grid_for(n_rows)](rows_in, rows_out)
    return out
