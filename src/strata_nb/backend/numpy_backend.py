"""The numpy backend: arrays are NumPy arrays and every op is its reference.

It runs the whole engine, streaming included, on any CPU: "VRAM" is an ordinary array of
the same capacity as it would be on a GPU, and the host copy is another. Everything stays
float32: one float64 scalar would silently promote a whole forward pass and cost ~3x.
"""
from __future__ import annotations

import importlib

import numpy as np

from ..model.dequant import dequantize


class NumpyBackend:
    name = "numpy"
    device = "cpu"

    # ---- arrays -------------------------------------------------------------------------
    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def asarray(self, a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def copy_into(self, dst, src):
        """dst[...] = src (a host table to its device twin; here they are often one array)."""
        if dst is not src:
            dst[...] = src

    def host_array(self, shape, dtype):
        """An array for the host copy (pinned and device-mapped on the cuda backend)."""
        return np.zeros(shape, dtype)

    def op(self, name: str):
        """The implementation of kernel file `kernels/<name>.py` this backend runs: its ref."""
        return getattr(importlib.import_module(f"strata_nb.kernels.{name}"), f"{name}_ref")

    # ---- weights ------------------------------------------------------------------------
    def matrix(self, *qtensors):
        """Weights as the matvec/matmul ops want them; several tensors are stacked by rows
        (fused q|k|v and gate|up projections: one call instead of three)."""
        return np.concatenate([dequantize(t.raw, t.qtype) for t in qtensors], axis=0)

    def vector(self, qtensor):
        return dequantize(qtensor.raw, qtensor.qtype).reshape(-1)

    # ---- ops ----------------------------------------------------------------------------
    # --8<-- [start:numpy_ops]
    def embed(self, table, ids):
        # table (vocab, d) float32, ids (n,) -> (n, d)
        return table[np.asarray(ids)]

    def matmul(self, x, w):
        # x (n, in) float32, w (out, in) float32 -> (n, out): y = x @ W.T, as GGUF stores W
        return x @ w.T

    def rmsnorm(self, x, w, eps: float):
        # x (n, d) float32, w (d,) float32
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / np.sqrt(ms + np.float32(eps))) * w

    def rope_qkv(self, qkv, cos, sin, n_heads: int, n_kv: int, hd: int):
        # qkv (n, (n_heads + 2 n_kv) hd) float32 -> q (n, n_heads, hd), k, v (n, n_kv, hd);
        # cos/sin (n, hd/2) float32 for each row's position. llama.cpp's converter permuted
        # the Q/K rows, so adjacent pairs (2i, 2i+1) rotate together.
        n = qkv.shape[0]
        qk = qkv[:, : (n_heads + n_kv) * hd].reshape(n, n_heads + n_kv, hd)
        x0, x1 = qk[..., 0::2], qk[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        rot = np.empty_like(qk)
        rot[..., 0::2] = x0 * c - x1 * s
        rot[..., 1::2] = x0 * s + x1 * c
        v = qkv[:, (n_heads + n_kv) * hd:].reshape(n, n_kv, hd)
        return rot[:, :n_heads], rot[:, n_heads:], np.ascontiguousarray(v)

    def swiglu(self, gate_up):
        # gate_up (n, 2 * ff) float32 -> (n, ff): silu(gate) * up
        g, u = np.split(gate_up, 2, axis=-1)
        return g / (1.0 + np.exp(-g)) * u

    def add_(self, x, y):
        x += y
        return x
    # --8<-- [end:numpy_ops]
