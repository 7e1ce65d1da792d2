"""The forward pass's compound verbs, composed from a backend's single ops one at a time.

`forward` (engine/forward.py) names the norm, RoPE, the KV append, the gate and the
residual add with the matrix product they come with. The numpy backend and the plain
cuda backend both run them as written here: each op is one reference call, or one plain
kernel launch. The fast backend (fast/backend.py) runs each as one fused launch instead.
`ahead`, the matrix a step multiplies next, is the fast backend's (it reads it into the
GPU's L2 meanwhile); a product here has nothing to do with it.
"""
from __future__ import annotations


class ComposedOps:
    """Needs the backend's matmul, rmsnorm, head_rmsnorm, rope_qkv, swiglu and add_."""

    # --8<-- [start:composed_ops]
    def normed_matmul(self, x, norm, eps: float, w, ahead=None):
        # rmsnorm(x) @ W.T
        return self.matmul(self.rmsnorm(x, norm, eps), w)

    def normed_matmul_rope(self, x, norm, eps: float, w, cos, sin, n_heads: int, n_kv: int, hd: int, ahead=None,
                           append=None, qk_norm=None):
        # rmsnorm(x) @ Wqkv.T, then RoPE on its q and k heads -> q, k, v; k and v written
        # to the cache when given where (kv/writer.py: Append). qk_norm: (q_norm, k_norm),
        # each q and k head RMS-normed before RoPE (Gemma 3)
        qkv = self.normed_matmul(x, norm, eps, w)
        if qk_norm is not None:
            qkv = self.head_rmsnorm(qkv, *qk_norm, eps, n_heads, n_kv)
        q, k, v = self.rope_qkv(qkv, cos, sin, n_heads, n_kv, hd)
        if append is not None:
            append.write(self, k, v)
        return q, k, v

    def matmul_add_(self, x, a, w, ahead=None):
        # x += a @ W.T, in place
        return self.add_(x, self.matmul(a, w))

    def gated_matmul_add_(self, x, gate_up, w, ahead=None):
        # x += swiglu(gate_up) @ W.T, in place
        return self.add_(x, self.matmul(self.swiglu(gate_up), w))
    # --8<-- [end:composed_ops]
