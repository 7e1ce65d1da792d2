"""The megakernel's host side: the model's matrices stacked by layer, and the decode step
the engine runs with `--kernels mega`.

The megakernel reaches every layer's weights and cells through one argument each: an
array whose first axis is the layer (`MegaModel`; the KV cache keeps a resident cache's
pools that way, kv/cache.py `stacked`). A step is DeviceStep's (engine/decode_step.py:
its token and position in device memory, run ahead, replayed from a CUDA graph) with one
launch where the fast tier's step has about 300.
"""
from __future__ import annotations

import numpy as np

from ...engine.decode_step import DeviceStep
from ...gpu.geometry import MEGA_SPLITS, MEGA_THREADS, SIMULATED, multiprocessors
from ...gpu.launch import absent, stream
from ...kernels.attention.attention import score_scale
from ...kernels.dense.gguf_rows import weight_views
from ...kernels.kv.kv_readers import SIDES, side_arrays
from ..backend import FastCudaBackend
from .interpreter import interpreter
from .plan import build_plan, layer_types, why_not


class MegaBackend(FastCudaBackend):
    """`--kernels mega`: the fast tier, whose decode steps the engine runs as MegaSteps
    where the megakernel can (plan.why_not); prompts, windows and the rest as the fast
    tier does."""

    kernels = "mega"


class MegaModel:
    """The weights as the megakernel reads them: each kind of matrix stacked by layer
    (a copy on the device: the fast tier keeps its own), norms too."""

    def __init__(self, be, weights):
        layers = weights.layers
        self.types = {"embd": weights.token_embd.qtype, "output": weights.output.qtype}
        self.views = {"embd": weight_views(weights.token_embd.raw, weights.token_embd.qtype),
                      "output": weight_views(weights.output.raw, weights.output.qtype)}
        for kind in ("wqkv", "wo", "wgate_up", "wdown"):
            mats = [getattr(L, kind) for L in layers]
            self.types[kind] = mats[0].qtype
            self.views[kind] = weight_views(stack(be, [m.raw for m in mats]), mats[0].qtype)
        self.attn_norm = stack(be, [L.attn_norm for L in layers])  # (layers, d) float32
        self.ffn_norm = stack(be, [L.ffn_norm for L in layers])
        self.out_norm = weights.output_norm


def stack(be, arrays):
    """(len(arrays), *shape): the arrays, one after the other, copied on the device."""
    first = arrays[0]
    out = be.empty((len(arrays), *first.shape), first.dtype)
    for i, a in enumerate(arrays):
        out[i].copy_to_device(a)
    return out


class MegaStep(DeviceStep):
    """A greedy decode step as one launch of the megakernel (interpreter.py)."""

    def __init__(self, be, weights, kv, use_graph: bool, model: MegaModel, clocked: bool = False):
        """clocked: block 0 notes when it sets out on each item (`item_ns`)."""
        super().__init__(be, weights, kv, use_graph, sampling=None)
        cfg, fmt = weights.config, kv.fmt
        self.plan = build_plan(cfg.n_layers)
        self.kernel = interpreter(model.types, fmt)
        self.grid = 1 if SIMULATED else multiprocessors()  # the simulator runs one block after another
        f32 = np.float32
        kind_k, kind_v = SIDES[fmt]
        ka, kb, va, vb = side_arrays(kind_k, "k", kv.stacked) + side_arrays(kind_v, "v", kv.stacked)
        no_host = [absent((0, *a.shape[2:]), a.dtype) for a in (ka, kb, va, vb)]
        hd, n_kv = cfg.head_dim, cfg.n_kv_heads
        self.logits = be.zeros((1, cfg.vocab_size), f32)
        x, q, k_new, v_new, part_m, part_l, part_acc, attn, h_ff = (be.zeros(shape, f32) for shape in (
            (1, cfg.d_model), (cfg.n_heads, hd), (1, n_kv, hd), (1, n_kv, hd), (cfg.n_heads, MEGA_SPLITS),
            (cfg.n_heads, MEGA_SPLITS), (cfg.n_heads, MEGA_SPLITS, hd), (cfg.n_heads, hd), (1, cfg.d_ff)))
        v = model.views
        self.args = (be.asarray(self.plan), be.zeros((2,), np.int32), self.token, self.pos, self.chosen,
                     f32(cfg.rms_eps), score_scale(hd), *v["embd"], *v["output"], model.out_norm,
                     model.attn_norm, model.ffn_norm, *v["wqkv"], *v["wo"], *v["wgate_up"], *v["wdown"],
                     weights.rope_cos, weights.rope_sin, kv.layers[0].page_table, ka, kb, va, vb, *no_host,
                     x, q, k_new, v_new, part_m, part_l, part_acc, be.zeros((n_kv,), np.int32), attn, h_ff,
                     self.logits, be.zeros((len(self.plan) + 1 if clocked else 0,), np.int64))

    @staticmethod
    def why_not(be, kv, weights, greedy: bool) -> str | None:
        """Why this step cannot run as a megakernel (the fast tier's runs), or None."""
        return why_not(weights.config, kv.fmt, kv.stacked is not None, greedy, layer_types(weights.layers))

    def item_ns(self) -> np.ndarray:
        """(items,) int64: the last step's nanoseconds on each item of the plan, its barrier
        included, as thread block 0 saw them (a clocked step only)."""
        stamps = self.be.to_numpy(self.args[-1])
        assert len(stamps), "a clocked MegaStep notes the times (MegaStep(..., clocked=True))"
        return np.diff(stamps)

    def launch(self):
        """The whole step: one launch (the forward pass, the pick and the move on)."""
        self.kernel[self.grid, MEGA_THREADS, stream()](*self.args)
        return self.logits
