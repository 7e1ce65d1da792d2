"""SwiGLU, the FFN's gate: the fused gate|up projection's two halves combined,
silu(gate) * up, with silu(g) = g / (1 + exp(-g)).

One thread per output value; it reads gate[j] and up[j] of its row (two coalesced
streams) and writes one value.

Tolerance: the kernel does the reference's operations in the same order; only exp
differs (CUDA's expf and NumPy's are each within a few ulp of exact). Through
1 + e, the division and the product that is at most 16 u relatively (u = 2^-24), so
|out - ref| <= 16 u |ref| + 1e-30; the 1e-30 is for g near -88.7, where one exp may
overflow to inf (silu = -0) while the other stays finite (silu ~ -1e-37).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for

RTOL = 16 * 2.0 ** -24
ATOL = 1e-30


# --8<-- [start:swiglu_ref]
def swiglu_ref(gate_up,  # (n, 2 ff) float32: gate values, then up values
               out):     # (n, ff) float32, written
    g, u = np.split(gate_up, 2, axis=-1)
    out[...] = g / (1.0 + np.exp(-g)) * u
# --8<-- [end:swiglu_ref]


# --8<-- [start:swiglu_kernel]
@cuda.jit(device=True)
def silu_times(g, u):
    """silu(g) * u: one gate value times its up value."""
    return g / (float32(1.0) + math.exp(-g)) * u


@cuda.jit(cache=True)
def swiglu_kernel(gate_up, out):  # shapes as swiglu_ref
    n, ff = out.shape
    lane = cuda.grid(1)  # one output value
    if lane < n * ff:
        i, j = lane // ff, lane % ff
        out[i, j] = silu_times(gate_up[i, j], gate_up[i, ff + j])
# --8<-- [end:swiglu_kernel]


def swiglu(gate_up, out):
    """Like swiglu_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("out", out, np.float32, (None, None))
    n, ff = out.shape
    expect("gate_up", gate_up, np.float32, (n, 2 * ff))
    if n * ff == 0:
        return
    with DeviceArgs() as dev:
        swiglu_kernel[grid_for(n * ff)](dev.read(gate_up), dev.write(out))
