"""The model's weights, placed on a backend in the form its ops want.

q|k|v and gate|up are stacked by rows so a layer's projections are two matmuls, not five.
A mixture-of-experts layer (cfg.n_expert > 0) has no dense FFN: a router here, and E
experts, each a gate|up matrix and a down matrix of its own, which the expert cache holds
(experts/cache.py; the engine builds it once the KV cache has taken its memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFModel, ModelConfig


@dataclass(slots=True)
class LayerWeights:
    attn_norm: object  # (d,) float32
    wqkv: object  # (n_heads*hd + 2*n_kv*hd, d): q rows, then k rows, then v rows
    wo: object  # (d, n_heads*hd)
    ffn_norm: object  # (d,) float32
    wgate_up: object = None  # (2*ff, d): gate rows, then up rows (None in an MoE layer)
    wdown: object = None  # (d, ff)
    router: object = None  # (E, d): one logit per expert (None in a dense layer)


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


# --8<-- [start:rope_tables]
def rope_tables(cfg: ModelConfig, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of pos * base^(-2i/hd) for each pair i, computed in float32 the way ggml does
    (theta multiplied by theta_scale once per pair), so positions agree with llama.cpp."""
    half = cfg.head_dim // 2
    theta_scale = np.float32(cfg.rope_base) ** np.float32(-2.0 / cfg.head_dim)
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
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        ffn = _router(be, model, p) if cfg.n_expert else dict(
            wgate_up=be.matrix(t(p + "ffn_gate.weight"), t(p + "ffn_up.weight")),
            wdown=be.matrix(t(p + "ffn_down.weight")))
        layers.append(LayerWeights(
            attn_norm=be.vector(t(p + "attn_norm.weight")),
            wqkv=be.matrix(t(p + "attn_q.weight"), t(p + "attn_k.weight"), t(p + "attn_v.weight")),
            wo=be.matrix(t(p + "attn_output.weight")),
            ffn_norm=be.vector(t(p + "ffn_norm.weight")),
            **ffn,
        ))
    embd = be.matrix(t("token_embd.weight"))
    output = be.matrix(t("output.weight")) if model.has("output.weight") else embd  # tied
    cos, sin = rope_tables(cfg, cfg.context_length)  # every position the model was trained for
    return ModelWeights(cfg, embd, output, be.vector(t("output_norm.weight")), layers,
                        be.asarray(cos), be.asarray(sin))


def _router(be, model: GGUFModel, p: str) -> dict:
    """An MoE layer's router, ffn_gate_inp (E, d) as llama.cpp stores it."""
    cfg = model.config
    return dict(router=be.matrix(model.tensor(p + "ffn_gate_inp.weight", shape=(cfg.n_expert, cfg.d_model))))
# --8<-- [end:load_weights]
