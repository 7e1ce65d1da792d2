"""The residual stream's in-place ops, one thread per value: the residual add x += y, and
the scale x *= s (Gemma multiplies the embedding rows by sqrt(d_model), in float32). A
single float32 add or product per value, the same as NumPy's, so each kernel equals its
reference bit for bit."""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for


# --8<-- [start:residual_ref]
def residual_ref(x,  # (n, d) float32: the residual stream, written
                 y):  # (n, d) float32: a block's output
    x += y
# --8<-- [end:residual_ref]


# --8<-- [start:residual_kernel]
@cuda.jit(cache=True)
def residual_kernel(x, y):  # shapes as residual_ref
    lane = cuda.grid(1)  # one value
    d = x.shape[1]
    if lane < x.shape[0] * d:
        x[lane // d, lane % d] += y[lane // d, lane % d]
# --8<-- [end:residual_kernel]


def residual(x, y):
    """Like residual_ref, on the device. A NumPy x is moved and written back."""
    expect("x", x, np.float32, (None, None))
    expect("y", y, np.float32, x.shape)
    if x.size == 0:
        return
    with DeviceArgs() as dev:
        residual_kernel[grid_for(x.size)](dev.write(x), dev.read(y))


# --8<-- [start:scale_ref]
def scale_ref(x,  # (n, d) float32: the residual stream, written
              s):  # float: rounded to float32 once, as the kernel gets it
    x *= np.float32(s)
# --8<-- [end:scale_ref]


# --8<-- [start:scale_kernel]
@cuda.jit(cache=True)
def scale_kernel(x, s):  # x as scale_ref; s float32
    lane = cuda.grid(1)  # one value
    d = x.shape[1]
    if lane < x.shape[0] * d:
        x[lane // d, lane % d] *= s
# --8<-- [end:scale_kernel]


def scale(x, s):
    """Like scale_ref, on the device. A NumPy x is moved and written back."""
    expect("x", x, np.float32, (None, None))
    if x.size == 0:
        return
    with DeviceArgs() as dev:
        scale_kernel[grid_for(x.size)](dev.write(x), np.float32(s))
