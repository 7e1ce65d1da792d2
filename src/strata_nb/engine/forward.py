"""One forward pass over a run of tokens: the path every token takes through the layers.

The same code serves a prompt chunk (n tokens), a decode step (1) and a verify window
(T <= 8); the backend `be` supplies the ops and the KV cache `kv` owns the K/V. The
norms, RoPE, the KV append, the gate and the residual adds are named with the matrix
products they come with (`normed_matmul`, `normed_matmul_rope`, `gated_matmul_add_`,
`matmul_add_`): the cuda backend fuses each into its matvec for a step, one kernel launch
instead of two or three (the append for fp16/fp32 cells; quantized ones keep their kernel).
Each product is told the one after it (`ahead`): the cuda backend's matvec reads those
weights into the GPU's L2 cache while it works, so the next one does not wait on HBM.
"""
from __future__ import annotations

from ..model.weights import ModelWeights


# --8<-- [start:forward]
def forward(be, w: ModelWeights, kv, ids, positions, prompt: bool, all_logits: bool = False, last=None):
    """ids, positions (n,) int32 NumPy -> logits (n or 1, vocab) float32.

    prompt: a prompt chunk (attends every earlier cell) rather than a decode step or
    verify window (attends the blocks its queries select). last: (1,) int32 in device
    memory, the last real row: the rows after it are padding, which the expert cache does
    not count as tokens (a padded prompt chunk, engine/prompt_chunk.py, or verify window,
    engine/verify_window.py); without all_logits, the row whose logits to make, instead
    of row n - 1."""
    cfg = w.config
    n, eps = len(ids), cfg.rms_eps
    pos = be.asarray(positions)
    x = be.embed(w.token_embd, be.asarray(ids))  # (n, d) the residual stream
    if cfg.embed_scale != 1:  # Gemma: x *= sqrt(d)
        be.scale_(x, cfg.embed_scale)
    rope = be.embed(w.rope_cos, pos), be.embed(w.rope_sin, pos)  # (n, hd/2) cos, sin
    rope_local = rope if w.rope_cos_local is None else (  # Gemma 3's local layers turn at a base of their own
        be.embed(w.rope_cos_local, pos), be.embed(w.rope_sin_local, pos))
    with be.rows_alone(prompt and kv.rows_alone):  # each prompt row as in any chunk (engine/prompt_chunk.py)
        for layer, L in enumerate(w.layers):
            after = w.layers[layer + 1].wqkv if layer + 1 < len(w.layers) else w.output  # the next product
            cos, sin = rope_local if cfg.local(layer) else rope
            # q (n, n_heads, hd), k and v (n, n_kv, hd): the q|k|v product, (Gemma) its q and
            # k heads normed, its q and k roped, k and v appended to the cache: host copy +
            # VRAM through the one writer
            q, k, v = be.normed_matmul_rope(x, L.attn_norm, eps, L.wqkv, cos, sin, cfg.n_heads, cfg.n_kv_heads,
                                            cfg.head_dim, ahead=L.wo, append=kv.append_to(layer, positions, prompt),
                                            qk_norm=None if L.q_norm is None else (L.q_norm, L.k_norm))
            a = kv.attend(layer, q, positions, prompt).reshape(n, cfg.n_heads * cfg.head_dim)  # (n, n_heads hd)
            if L.post_attn_norm is None:  # x += a Wo
                be.matmul_add_(x, a, L.wo, ahead=L.wgate_up if L.router is None else L.router)
            else:  # Gemma: x += rmsnorm(a Wo)
                be.add_(x, be.rmsnorm(be.matmul(a, L.wo), L.post_attn_norm, eps))
            if L.router is None:  # a dense FFN
                gate_up = be.normed_matmul(x, L.ffn_norm, eps, L.wgate_up, ahead=L.wdown)  # (n, 2 ff)
                if L.post_ffn_norm is None:
                    be.gated_matmul_add_(x, gate_up, L.wdown, ahead=after)  # x += swiglu(gate_up) Wdown
                else:  # Gemma: x += rmsnorm(geglu(gate_up) Wdown)
                    gated = be.geglu(gate_up) if cfg.gate == "gelu_tanh" else be.swiglu(gate_up)
                    be.add_(x, be.rmsnorm(be.matmul(gated, L.wdown), L.post_ffn_norm, eps))
            else:  # experts: each token's K of E SwiGLU FFNs, weighted by the router, from the expert cache
                be.moe_ffn_add_(x, L.ffn_norm, eps, L.router, w.experts, layer, ahead=after, last=last)
    if not all_logits:  # one row's logits: row last[0], gathered on the device, or the last row
        x = x[n - 1:] if last is None else be.embed(x, last)
    return be.normed_matmul(x, w.output_norm, eps, w.output, ahead=w.layers[0].wqkv)  # the next step's first
# --8<-- [end:forward]
