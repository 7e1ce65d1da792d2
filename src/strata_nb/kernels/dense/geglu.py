"""GeGLU, the Gemma FFN's gate: the fused gate|up projection's two halves combined,
gelu_tanh(gate) * up, with

    gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))

the tanh form of GELU. llama.cpp's ggml_gelu is this form (written
sqrt(2/pi) g (1 + 0.044715 g^2)); its CPU backend reads it from a table of 65536 fp16
values indexed by g rounded to fp16, for -10 < g < 10, and takes 0 or g outside. The
engine's reference is the float32 formula, every constant and step in float32.

One thread per output value, as swiglu: it reads gate[j] and up[j] of its row (two
coalesced streams) and writes one value.

Tolerance: the kernel does the reference's operations in the same order; tanh differs
(CUDA's tanhf is within 2 ulp of exact, NumPy's float32 tanh within a few; take 4), and
the GPU may fuse a product and a sum into one rounding, which only removes one. So bound
each side against the exact function of the same float32 inputs and constants
(u = 2^-24), with z = sqrt(2/pi) (g + 0.044715 g^3):
- z: four roundings (three products, a sum of two terms of one sign) and the product
  by sqrt(2/pi): within 5 u |z|. Through tanh that moves 1 + tanh(z) by
  sech^2(z) 5 u |z| <= 2.3 u, as sech^2(z) |z| <= 0.45 for every z;
- tanh itself, within k ulp of a value below 1 in size: k u; the sum 1 + tanh: u more;
- the products by 0.5 (exact), (1 + tanh) and up: 2 u relatively.
So each side is within 2 u |out| + (k + 3.3) u |0.5 g up|, and the two within
4 u |ref| + (2 + 4 + 6.6) / 2 u |g up|, rounded up to 8 u |ref| + 8 u |g up|. The
|g up| term matters for g below about -3, where 1 + tanh(z) is a small difference
read off a tanh close to -1 (at g = -5 it is 1.5 u, and for g < -5.5 tanh(z) rounds to
-1 and the output to 0), so the output keeps only an absolute accuracy in u |g up|.
ATOL covers results that fall below float32's normal range, rounded in absolute steps of
2^-149.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for

SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
GELU_C = np.float32(0.044715)
RTOL = 8 * 2.0 ** -24  # of |ref|
GTOL = 8 * 2.0 ** -24  # of |gate * up|
ATOL = 2.0 ** -126


# --8<-- [start:geglu_ref]
def geglu_ref(gate_up,  # (n, 2 ff) float32: gate values, then up values
              out):     # (n, ff) float32, written
    g, u = np.split(gate_up, 2, axis=-1)
    z = SQRT_2_OVER_PI * (g + GELU_C * g * g * g)  # float32 constants: no float64 anywhere
    out[...] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(z)) * u


def geglu_tolerance(gate_up, ref):
    """|kernel - ref| bound, elementwise (module docstring)."""
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return RTOL * np.abs(ref) + GTOL * np.abs(g * u) + ATOL
# --8<-- [end:geglu_ref]


# --8<-- [start:geglu_kernel]
@cuda.jit(cache=True)
def geglu_kernel(gate_up, out):  # shapes as geglu_ref
    n, ff = out.shape
    lane = cuda.grid(1)  # one output value
    if lane < n * ff:
        i, j = lane // ff, lane % ff
        g, u = gate_up[i, j], gate_up[i, ff + j]
        z = SQRT_2_OVER_PI * (g + GELU_C * g * g * g)
        out[i, j] = float32(0.5) * g * (float32(1.0) + math.tanh(z)) * u
# --8<-- [end:geglu_kernel]


def geglu(gate_up, out):
    """Like geglu_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("out", out, np.float32, (None, None))
    n, ff = out.shape
    expect("gate_up", gate_up, np.float32, (n, 2 * ff))
    if n * ff == 0:
        return
    with DeviceArgs() as dev:
        geglu_kernel[grid_for(n * ff)](dev.read(gate_up), dev.write(out))
