"""The model's weights, placed on a backend in the form its ops want.

q|k|v and gate|up are stacked by rows so a layer's projections are two matmuls, not five.
A mixture-of-experts layer (cfg.n_expert > 0) has no dense FFN: a router here, and E
experts, each a gate|up matrix and a down matrix of its own, which the expert cache holds
(experts/cache.py; the engine builds it once the KV cache has taken its memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFModel, ModelConfig, QTensor


@dataclass(slots=True)
class LayerWeights:
    attn_norm: object  # (d,) float32
    wqkv: object  # (n_heads*hd + 2*n_kv*hd, d): q rows, then k rows, then v rows
    wo: object  # (d, n_heads*hd)
    ffn_norm: object  # (d,) float32
    wgate_up: object = None  # (2*ff, d): gate rows, then up rows (None in an MoE layer)
    wdown: object = None  # (d, ff)
    router: object = None  # (E, d): one logit per expert (None in a dense layer)
    q_norm: object = None  # (hd,) float32: QK-norm's weights (cfg.qk_norm), else None
    k_norm: object = None  # (hd,)
    post_attn_norm: object = None  # (d,): the attention output's norm (cfg.post_norms), else None
    post_ffn_norm: object = None  # (d,): the FFN output's


@dataclass(slots=True)
class ModelWeights:
    config: ModelConfig
    token_embd: object  # (vocab, d): the embedding table and, tied, the output head
    output: object  # (vocab, d): the output head (the same array as token_embd when tied)
    output_norm: object  # (d,)
    layers: list[LayerWeights]
    rope_cos: object  # (context_length, hd/2) float32
    rope_sin: object  # (context_length, hd/2) float32
    experts: object = None  # an MoE model's ExpertCache (experts/cache.py), set by the engine
    rope_cos_local: object = None  # a local layer's tables, at cfg.rope_base_local (None: as the others)
    rope_sin_local: object = None


# --8<-- [start:rope_tables]
def rope_tables(cfg: ModelConfig, n_pos: int, base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of pos * base^(-2i/hd) for each pair i, computed in float32 the way ggml does
    (theta multiplied by theta_scale once per pair), so positions agree with llama.cpp.
    base: the model's (cfg.rope_base) unless given."""
    half = cfg.head_dim // 2
    theta_scale = np.float32(cfg.rope_base if base is None else base) ** np.float32(-2.0 / cfg.head_dim)
    theta = np.empty((n_pos, half), np.float32)
    theta[:, 0] = np.arange(n_pos, dtype=np.float32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * theta_scale
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
# --8<-- [end:rope_tables]


# --8<-- [start:load_weights]
def load_weights(be, model: GGUFModel) -> ModelWeights:
    cfg = model.config
    t = model.tensor
    layers = []
    if cfg.rope_halves:  # q and k heads in the order the kernels turn pairs in (halves_to_pairs)
        t = lambda name: halves_to_pairs(model.tensor(name), cfg.head_dim)  # noqa: E731
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        ffn = _router(be, model, p) if cfg.n_expert else dict(
            wgate_up=be.matrix(t(p + "ffn_gate.weight"), t(p + "ffn_up.weight")),
            wdown=be.matrix(t(p + "ffn_down.weight")))
        family = {}
        if cfg.qk_norm:
            family |= dict(q_norm=be.vector(t(p + "attn_q_norm.weight")), k_norm=be.vector(t(p + "attn_k_norm.weight")))
        if cfg.post_norms:
            family |= dict(post_attn_norm=be.vector(t(p + "post_attention_norm.weight")),
                           post_ffn_norm=be.vector(t(p + "post_ffw_norm.weight")))
        layers.append(LayerWeights(
            attn_norm=be.vector(t(p + "attn_norm.weight")),
            wqkv=be.matrix(t(p + "attn_q.weight"), t(p + "attn_k.weight"), t(p + "attn_v.weight")),
            wo=be.matrix(t(p + "attn_output.weight")),
            ffn_norm=be.vector(t(p + "ffn_norm.weight")),
            **ffn, **family,
        ))
    embd = be.matrix(t("token_embd.weight"))
    output = be.matrix(t("output.weight")) if model.has("output.weight") else embd  # tied
    cos, sin = rope_tables(cfg, cfg.context_length)  # every position the model was trained for
    local = {}
    if cfg.rope_base_local:
        cos_l, sin_l = rope_tables(cfg, cfg.context_length, cfg.rope_base_local)
        local = dict(rope_cos_local=be.asarray(cos_l), rope_sin_local=be.asarray(sin_l))
    return ModelWeights(cfg, embd, output, be.vector(t("output_norm.weight")), layers,
                        be.asarray(cos), be.asarray(sin), **local)


# --8<-- [start:halves_to_pairs]
def halves_to_pairs(qt: QTensor, hd: int) -> QTensor:
    """A q or k weight (or QK-norm) of a model whose RoPE turns value i with value i + hd/2
    of each head (NeoX, Gemma's), with its rows reordered so that those two sit side by
    side, at 2i and 2i + 1: the pairs the RoPE kernel turns (llama.cpp's converter did the
    same to llama's weights). Scores are dot products over a head, which a reordering of
    both q and k leaves as they were; V, and so the attention output, is not reordered.
    Other tensors pass unchanged; rows are whole GGUF rows, so a quantized one moves as is."""
    name = qt.name
    if not name.endswith(("attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight")):
        return qt
    order = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)  # 0, hd/2, 1, hd/2 + 1, ...
    if qt.shape[0] == 1:  # a norm: one row of hd F32 values (4 bytes each)
        assert qt.qtype == "F32", f"{name} is {qt.qtype}; a QK-norm is F32"
        raw = qt.raw.reshape(hd, 4)[order].reshape(1, -1)
    else:  # a projection: out = heads * hd rows
        heads = qt.shape[0] // hd
        raw = qt.raw.reshape(heads, hd, -1)[:, order].reshape(qt.shape[0], -1)
    return QTensor(qt.name, qt.qtype, qt.shape, np.ascontiguousarray(raw))
# --8<-- [end:halves_to_pairs]


def _router(be, model: GGUFModel, p: str) -> dict:
    """An MoE layer's router, ffn_gate_inp (E, d) as llama.cpp stores it."""
    cfg = model.config
    return dict(router=be.matrix(model.tensor(p + "ffn_gate_inp.weight", shape=(cfg.n_expert, cfg.d_model))))
# --8<-- [end:load_weights]
