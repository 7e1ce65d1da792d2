"""Mixture of experts: the FFN of an MoE layer, routed per token as llama.cpp routes it.

A router scores every expert for each token (one logit each), a softmax over all E turns
the logits into probabilities, the token takes its K most probable experts, and their K
probabilities are renormalized to sum to 1 (llama.cpp's llama architecture: softmax
gating, `norm_w`). Each chosen expert is a SwiGLU FFN of its own (gate, up, down); the
token's FFN output is the weighted sum of its K experts' outputs, added to the residual.

Index legend, in the manner of gpt-fast:

    T tokens   E experts   D model dim   F one expert's FFN width   K experts used

The reference runs each expert once, over the tokens that chose it (a gather by expert),
rather than each token's K experts one by one: that is the order a device kernel reads
weights in, each expert's matrices once per pass.

These two functions are the spec. The engine runs the layer as three kernels, each beside
a reference of its own that reads the expert cache (experts/cache.py): route.py (the norm,
the router, top-K and the counters), expert_gate_up.py and expert_down.py (the chosen
experts' rows from a VRAM slot or the host copy). tests/kernels/test_expert_kernels.py
holds the three references, composed, to moe_ffn_ref.
"""
from __future__ import annotations

import numpy as np

from strata_nb.kernels.dense.matvec import product_ref
from strata_nb.kernels.dense.swiglu import swiglu_ref


# --8<-- [start:moe_route_ref]
def moe_route_ref(x_norm,  # (T, D) float32: the FFN's normed input
                  router,  # (E, D) float32
                  k: int):
    """-> chosen (T, K) int64 expert ids, most probable first, and weights (T, K) float32
    that sum to 1 per token. Ties go to the lower expert id (a stable sort)."""
    logits = product_ref(x_norm, router)  # (T, E)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)  # (T, E) softmax over all E experts
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :k]  # (T, K)
    weights = np.take_along_axis(p, chosen, axis=1)  # (T, K)
    return chosen, weights / weights.sum(axis=1, keepdims=True)
# --8<-- [end:moe_route_ref]


# --8<-- [start:moe_ffn_ref]
def moe_ffn_ref(x,        # (T, D) float32: the residual stream, added into
                x_norm,   # (T, D) float32: rmsnorm(x) * ffn_norm, the FFN's input
                router,   # (E, D) float32
                gate_up,  # E matrices (2F, D) float32: expert e's gate rows, then its up rows
                down,     # E matrices (D, F) float32
                k: int):  # K, the experts each token takes
    """x += sum over each token's K chosen experts of weight * down(swiglu(gate|up(x_norm)))."""
    chosen, weights = moe_route_ref(x_norm, router, k)  # (T, K) each
    out = np.zeros_like(x)  # (T, D): the experts' weighted sum, added to x once at the end
    for e in range(len(gate_up)):
        rows, place = np.nonzero(chosen == e)  # (T_e,): the tokens that chose e, and where in their K
        if len(rows) == 0:
            continue  # no token chose it: its weights are not read
        h = np.empty((len(rows), down[e].shape[1]), np.float32)  # (T_e, F)
        swiglu_ref(product_ref(x_norm[rows], gate_up[e]), h)
        out[rows] += weights[rows, place, None] * product_ref(h, down[e])  # a token chooses e at most once
    x += out
    return x
# --8<-- [end:moe_ffn_ref]
