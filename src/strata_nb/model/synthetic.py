"""Write a llama-architecture (or Gemma 3) GGUF with random weights.

Tests use tiny ones (a file in milliseconds, a forward pass in microseconds); benchmarks use
one with the default model's shapes, since only the shapes decide the speed. The vocabulary
is GPT-2's 256-byte alphabet plus the ChatML special tokens, with no merges, unless the
caller passes tokens and merges (e.g. the default model's).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..text.tokenizer import _byte_decoder
from .dequant import BLOCK_BYTES, K_QUANT_F16, QK_K

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def write_synthetic_gguf(path: str | Path, *, n_layers: int = 2, d_model: int = 128, d_ff: int = 192,
                         n_heads: int = 2, n_kv_heads: int = 1, head_dim: int = 64, context: int = 512,
                         qtype: str = "Q4_1", seed: int = 0, tokens: list[str] | None = None,
                         merges: list[str] | None = None, extra_tensor: tuple | None = None,
                         architecture: str = "llama", window: int = 32, chat_template: bool = True) -> Path:
    """Write the file and return its path. `extra_tensor=(name, array, GGMLQuantizationType)`
    adds one raw tensor (used to test the unsupported-type error). architecture "gemma3":
    Gemma 3's tensors and keys too (QK-norms, post-norms, a sliding `window`; every sixth
    layer global, as llama.cpp has it). chat_template False: a base model's file, without one."""
    import gguf

    rng = np.random.default_rng(seed)
    if tokens is None:
        tokens = SPECIALS + sorted(_byte_decoder(), key=_byte_decoder().get)
        merges = []
    types = [3 if t in SPECIALS else 1 for t in tokens]
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("synthetic")
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1e6 if architecture == "gemma3" else 10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges or [])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHATML)
    gemma = architecture == "gemma3"
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(window)

    def matrix(name, rows, cols, q=qtype, scale=0.08):
        t = getattr(gguf.GGMLQuantizationType, q)
        if q in K_QUANT_F16:  # gguf-py cannot quantize to these: random codes, scales sized to `scale`
            data = random_k_quant_rows(rng, q, rows, cols, scale)
        else:
            a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
            data = a if q == "F32" else gguf.quants.quantize(a, t)
        w.add_tensor(name, data, raw_dtype=t)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    qd, kd = n_heads * head_dim, n_kv_heads * head_dim
    matrix("token_embd.weight", len(tokens), d_model, q="Q8_0", scale=0.5)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d_model)
        matrix(p + "attn_q.weight", qd, d_model)
        matrix(p + "attn_k.weight", kd, d_model)
        matrix(p + "attn_v.weight", kd, d_model)
        matrix(p + "attn_output.weight", d_model, qd)
        norm(p + "ffn_norm.weight", d_model)
        if gemma:
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
            norm(p + "post_attention_norm.weight", d_model)
            norm(p + "post_ffw_norm.weight", d_model)
        matrix(p + "ffn_gate.weight", d_ff, d_model)
        matrix(p + "ffn_up.weight", d_ff, d_model)
        matrix(p + "ffn_down.weight", d_model, d_ff)
    norm("output_norm.weight", d_model)
    if extra_tensor is not None:
        name, array, t = extra_tensor
        w.add_tensor(name, array, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def random_k_quant_rows(rng: np.random.Generator, qtype: str, rows: int, cols: int, scale: float) -> np.ndarray:
    """(rows, bytes_per_row) uint8: random codes, scales and mins in every super-block, its
    fp16 d (and dmin) chosen so the weights spread about `scale` (cols a multiple of 256)."""
    assert cols % QK_K == 0, f"a {qtype} row is whole super-blocks of {QK_K}, not {cols}"
    raw = rng.integers(0, 256, (rows, cols // QK_K, BLOCK_BYTES[qtype]), dtype=np.uint8)
    step = scale / (300 if qtype != "Q6_K" else 1000)  # a code times a 6- or 8-bit scale is up to ~1,000 steps
    for at in K_QUANT_F16[qtype]:
        raw[..., at:at + 2] = np.full(raw.shape[:2] + (1,), step, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# The default model's shapes (SmolLM2-135M): what decides a benchmark's speed.
DEFAULT_SHAPES = dict(n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3, head_dim=64)
DEFAULT_VOCAB = 49152


def write_default_shapes_gguf(path: str | Path, context: int = 8192, seed: int = 1) -> Path:
    """Random weights in the default model's shapes and vocabulary size (filler tokens
    `tok<i>` after the bytes), so the output head is as large as the real one."""
    tokens = SPECIALS + sorted(_byte_decoder(), key=_byte_decoder().get)
    tokens += ["to"] + [f"tok{i}" for i in range(DEFAULT_VOCAB - len(tokens) - 1)]
    # one merge: llama.cpp refuses a BPE vocabulary whose file has no merges key, and
    # gguf writes no key for an empty list (bench --llama-bench runs llama.cpp on this file)
    return write_synthetic_gguf(path, **DEFAULT_SHAPES, context=context, seed=seed, tokens=tokens,
                                merges=["t o"])
