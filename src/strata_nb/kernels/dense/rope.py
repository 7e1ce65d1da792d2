"""RoPE on the fused q|k|v projection: split each row into q, k and v heads, and rotate q
and k by their position's angles (docs/design.md, "The default model": adjacent pairs).

llama.cpp's converter permuted the Q/K rows of the stored weights, so on them the pairs
that rotate together are (2i, 2i+1), by angle pos * base^(-2i/hd); the cos/sin rows come
from the rope tables gathered by position (embed.py). V passes through unrotated.

One thread per (row, head, pair): it reads two neighbouring values and writes two, so
neighbouring threads touch neighbouring memory. The products go through `mul_rn`
(kernels/kv/quant_q4_0.py) so the GPU compiler cannot fuse `x0 * c - x1 * s` into one
fma: each product rounds on its own, as in NumPy, and the kernel equals the reference
bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for
from strata_nb.kernels.kv.quant_q4_0 import mul_rn


# --8<-- [start:rope_qkv_ref]
def rope_qkv_ref(qkv,  # (n, (n_heads + 2 n_kv) hd) float32: q heads, then k heads, then v heads
                 cos,  # (n, hd/2) float32: each row's position, pair i
                 sin,  # (n, hd/2) float32
                 q,    # (n, n_heads, hd) float32, written
                 k,    # (n, n_kv, hd) float32, written
                 v):   # (n, n_kv, hd) float32, written
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    qk = qkv[:, : (n_heads + n_kv) * hd].reshape(n, n_heads + n_kv, hd)
    x0, x1 = qk[..., 0::2], qk[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = np.empty_like(qk)
    rot[..., 0::2] = x0 * c - x1 * s
    rot[..., 1::2] = x0 * s + x1 * c
    q[...] = rot[:, :n_heads]
    k[...] = rot[:, n_heads:]
    v[...] = qkv[:, (n_heads + n_kv) * hd:].reshape(n, n_kv, hd)
# --8<-- [end:rope_qkv_ref]


# --8<-- [start:rope_qkv_kernel]
@cuda.jit(device=True)
def turn_pair(x0, x1, c, s):
    """A pair turned by the angle whose cos and sin are c, s: each product rounded on its
    own (mul_rn, no fused multiply-add), as NumPy rounds the reference's."""
    return mul_rn(x0, c) - mul_rn(x1, s), mul_rn(x0, s) + mul_rn(x1, c)


@cuda.jit(cache=True)
def rope_qkv_kernel(qkv, cos, sin, q, k, v):  # shapes as rope_qkv_ref
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    half, heads = hd // 2, n_heads + 2 * n_kv
    lane = cuda.grid(1)  # one (row, head, pair)
    if lane >= n * heads * half:
        return
    i, h, pair = lane // (heads * half), lane // half % heads, lane % half
    x0 = qkv[i, h * hd + 2 * pair]
    x1 = qkv[i, h * hd + 2 * pair + 1]
    if h >= n_heads + n_kv:  # a V head: copied as it is
        v[i, h - n_heads - n_kv, 2 * pair] = x0
        v[i, h - n_heads - n_kv, 2 * pair + 1] = x1
        return
    c, s = cos[i, pair], sin[i, pair]
    dst, head = (q, h) if h < n_heads else (k, h - n_heads)
    dst[i, head, 2 * pair], dst[i, head, 2 * pair + 1] = turn_pair(x0, x1, c, s)
# --8<-- [end:rope_qkv_kernel]


def rope_qkv(qkv, cos, sin, q, k, v):
    """Like rope_qkv_ref, on the device; the head counts and hd come from q and k.
    NumPy arguments are moved (q, k, v are written back)."""
    expect("q", q, np.float32, (None, None, None))
    n, n_heads, hd = q.shape
    assert hd % 2 == 0, f"head_dim {hd} is odd: RoPE rotates pairs"
    expect("k", k, np.float32, (n, None, hd))
    n_kv = k.shape[1]
    expect("v", v, np.float32, (n, n_kv, hd))
    expect("qkv", qkv, np.float32, (n, (n_heads + 2 * n_kv) * hd))
    expect("cos", cos, np.float32, (n, hd // 2))
    expect("sin", sin, np.float32, (n, hd // 2))
    lanes = n * (n_heads + 2 * n_kv) * (hd // 2)
    if lanes == 0:
        return
    with DeviceArgs() as dev:
        rope_qkv_kernel[grid_for(lanes)](dev.read(qkv), dev.read(cos), dev.read(sin),
                                         dev.write(q), dev.write(k), dev.write(v))
