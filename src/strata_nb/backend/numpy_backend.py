"""The numpy backend: arrays are NumPy arrays and every op is its reference.

It runs the whole engine, streaming included, on any CPU: "VRAM" is an ordinary array of
the same capacity as it would be on a GPU, and the host copy is another. Everything stays
float32: one float64 scalar would silently promote a whole forward pass and cost ~3x.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..kernels.experts.expert_down import expert_down_ref
from ..kernels.experts.expert_gate_up import expert_gate_up_ref
from ..kernels.experts.route import route_ref
from ..kernels.dense.geglu import geglu_ref
from ..kernels.dense.matvec import product_ref
from ..kernels.dense.residual import scale_ref
from ..kernels.dense.rmsnorm import head_rmsnorm_ref, rmsnorm_ref
from ..kernels.dense.rope import rope_qkv_ref
from ..kernels.dense.swiglu import swiglu_ref
from ..model.dequant import dequantize
from .composed import ComposedOps


class NumpyBackend(ComposedOps):
    name = "numpy"
    kernels = "reference"  # what runs each op: the NumPy references (settings.KERNELS is for the cuda backend)
    misses_cross_a_bus = False  # an expert cache's "host copy" and "slots" are both host arrays here
    prefill_chunk = 256  # prompt tokens per forward pass unless --prefill-chunk says otherwise
    device = "cpu"

    # ---- arrays -------------------------------------------------------------------------
    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def asarray(self, a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def copy_batch(self, pairs, to_host: bool):
        """For every (host, device) pair: host <- device's first len(host) rows (to_host), else
        those rows <- host: the cuda backend's batch of copies."""
        for host, device in pairs:
            if to_host:
                host[...] = device[:len(host)]
            else:
                device[:len(host)] = host

    def pinned_bytes(self, nbytes: int) -> np.ndarray:
        """(nbytes,) uint8 host memory: pinned on the cuda backend; here there is no device to copy to."""
        return np.empty(nbytes, np.uint8)

    def queue_copy(self, dst, src):
        """dst[...] = src now: the cuda backend's copy queued between launches (here each
        op has run by the time it returns)."""
        dst[...] = src

    def queue_mark(self):
        """The cuda backend's event after what is queued: here everything has run."""
        return _Done()

    def copy_into(self, dst, src):
        """dst[...] = src (a host table to its device twin; here they are often one array)."""
        if dst is not src:
            dst[...] = src

    def rows_alone(self, on: bool):
        """The cuda backend's scope for a prompt chunk whose rows must not depend on its
        size; the references here make no such promise (serve/conversations.py)."""
        return contextlib.nullcontext()

    def deferred_frees(self):
        """The cuda backend's scope for one forward pass; nothing to defer here."""
        return contextlib.nullcontext()

    def check_model(self, cfg, qsa: bool, max_context: int = 0):
        """The references take every shape the KV formats allow (kv_layout.py)."""

    def dependent_launches(self) -> str:
        """How the cuda backend launches its marked kernels (fast/dependent_launch.py)."""
        return "no GPU"

    def prompt_kernels(self, head_dim: int) -> str:
        """What a prompt chunk's matmuls and attention run on the cuda backend; here the references."""
        return "reference"

    def host_array(self, shape, dtype):
        """An array for the host copy (pinned and device-mapped on the cuda backend)."""
        return np.zeros(shape, dtype)

    def op(self, ref, launcher):
        """Which of a kernel file's two functions this backend runs: the NumPy reference.
        Callers name both (`be.op(kv_append_q8_ref, kv_append_q8)`), so either is one
        go-to-definition away."""
        return ref

    # ---- weights ------------------------------------------------------------------------
    def matrix(self, *qtensors):
        """Weights as the matvec/matmul ops want them; several tensors are stacked by rows
        (fused q|k|v and gate|up projections: one call instead of three)."""
        return np.concatenate([dequantize(t.raw, t.qtype) for t in qtensors], axis=0)

    def vector(self, qtensor):
        return dequantize(qtensor.raw, qtensor.qtype).reshape(-1)

    # ---- the expert cache's memory (experts/cache.py) -----------------------------------
    def expert_host_copy(self, raw, qtype):
        """(n, rows, bytes) uint8 GGUF rows of n expert matrices -> (n, rows, cols) float32."""
        return np.stack([dequantize(m, qtype) for m in raw])

    def expert_slots(self, n: int, host):
        """n slots shaped as one of the host copy's matrices ("VRAM" is an ordinary array here)."""
        return np.zeros((n, *host.shape[1:]), host.dtype)

    def free_memory(self):
        """Free device memory in bytes; None: no device, every expert fits."""
        return None

    # ---- ops ----------------------------------------------------------------------------
    # --8<-- [start:numpy_ops]
    def embed(self, table, ids):
        # table (vocab, d) float32, ids (n,) -> (n, d)
        return table[np.asarray(ids)]

    def matmul(self, x, w):
        # x (n, in) float32, w (out, in) float32 -> (n, out): y = x @ W.T, as GGUF stores W;
        # a step's or a window's rows one at a time (product_ref says why)
        return product_ref(x, w)

    def rmsnorm(self, x, w, eps: float):
        # x (n, d) float32, w (d,) float32 -> (n, d)
        out = np.empty_like(x)
        rmsnorm_ref(x, w, eps, out)
        return out

    def rope_qkv(self, qkv, cos, sin, n_heads: int, n_kv: int, hd: int):
        # qkv (n, (n_heads + 2 n_kv) hd) float32 -> q (n, n_heads, hd), k, v (n, n_kv, hd);
        # cos/sin (n, hd/2) float32: each row's position (kernels/dense/rope.py says which pairs turn)
        n = qkv.shape[0]
        q, k, v = (np.empty((n, heads, hd), np.float32) for heads in (n_heads, n_kv, n_kv))
        rope_qkv_ref(qkv, cos, sin, q, k, v)
        return q, k, v

    def swiglu(self, gate_up):
        # gate_up (n, 2 ff) float32 -> (n, ff): silu(gate) * up
        out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        swiglu_ref(gate_up, out)
        return out

    def add_(self, x, y):
        x += y
        return x

    def moe_ffn_add_(self, x, norm, eps: float, router, experts, layer: int, ahead=None, last=None):
        # x += the FFN of an MoE layer: rmsnorm(x) routed to K of E experts, each read from
        # its slot or the host copy of the expert cache `experts` (kernels/experts/); rows
        # after `last` (padding) are not counted as the cache's lookups
        n, k, at = x.shape[0], experts.k, experts.at(layer)
        x_norm = np.empty_like(x)  # (n, d)
        chosen, weights = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
        route_ref(x, norm, eps, router, x_norm, chosen, weights, np.empty((n, k), np.int32), experts.res, at,
                  experts.lookups, experts.hits, None if last is None else np.asarray(last))
        h = np.empty((n, k, experts.host_gate_up.shape[1] // 2), np.float32)  # (n, K, F)
        expert_gate_up_ref(x_norm, chosen, experts.res, at, experts.slot_gate_up, experts.host_gate_up, h)
        expert_down_ref(h, chosen, weights, experts.res, at, experts.slot_down, experts.host_down, x)
        return x

    def geglu(self, gate_up):
        # gate_up (n, 2 ff) float32 -> (n, ff): gelu_tanh(gate) * up (Gemma's FFN)
        out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        geglu_ref(gate_up, out)
        return out

    def head_rmsnorm(self, qkv, q_norm, k_norm, eps: float, n_heads: int, n_kv: int):
        # qkv (n, (n_heads + 2 n_kv) hd) float32 -> the same shape: each q head RMS-normed
        # with q_norm (hd,), each k head with k_norm (hd,), v heads copied (Gemma 3's QK-norm)
        out = np.empty(qkv.shape, np.float32)
        head_rmsnorm_ref(qkv, q_norm, k_norm, eps, n_heads, n_kv, out)
        return out

    def scale_(self, x, s: float):
        # x (n, d) float32 *= float32(s), in place (Gemma's embedding rows times sqrt(d_model))
        scale_ref(x, s)
        return x
    # --8<-- [end:numpy_ops]


class _Done:
    """A mark that has fired."""

    def synchronize(self):
        pass
