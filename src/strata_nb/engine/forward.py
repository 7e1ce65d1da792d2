"""One forward pass over a run of tokens: the path every token takes through the layers.

The same code serves a prompt chunk (n tokens), a decode step (1) and a verify window
(T <= 8); the backend `be` supplies the ops and the KV cache `kv` owns the K/V.
"""
from __future__ import annotations

from ..model.weights import ModelWeights


# --8<-- [start:forward]
def forward(be, w: ModelWeights, kv, ids, positions, prompt: bool, all_logits: bool = False):
    """ids, positions (n,) int32 NumPy -> logits (n or 1, vocab) float32.

    prompt: a prompt chunk (attends every earlier cell) rather than a decode step or
    verify window (attends the blocks its queries select)."""
    cfg = w.config
    n, eps = len(ids), cfg.rms_eps
    pos = be.asarray(positions)
    x = be.embed(w.token_embd, be.asarray(ids))  # (n, d) the residual stream
    cos, sin = be.embed(w.rope_cos, pos), be.embed(w.rope_sin, pos)  # (n, hd/2)
    for layer, L in enumerate(w.layers):
        h = be.rmsnorm(x, L.attn_norm, eps)
        qkv = be.matmul(h, L.wqkv)  # (n, (n_heads + 2 n_kv) hd)
        q, k, v = be.rope_qkv(qkv, cos, sin, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        kv.append(layer, positions, k, v, prompt)  # host copy + VRAM through the one writer
        a = kv.attend(layer, q, positions, prompt)  # (n, n_heads, hd)
        x = be.add_(x, be.matmul(a.reshape(n, cfg.n_heads * cfg.head_dim), L.wo))
        h = be.rmsnorm(x, L.ffn_norm, eps)
        x = be.add_(x, be.matmul(be.swiglu(be.matmul(h, L.wgate_up)), L.wdown))
    if not all_logits:
        x = x[n - 1:]
    return be.matmul(be.rmsnorm(x, w.output_norm, eps), w.output)
# --8<-- [end:forward]
