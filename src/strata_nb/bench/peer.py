"""The peer, measured in the same run: HF transformers on the same shapes, on the same GPU.

A LlamaForCausalLM built from our model's config (layers, widths, heads, vocabulary, tied
head) with random bf16 weights: speed depends on the shapes, not the values. Eager
attention, as `transformers` runs a model by default; then its static-cache path, if the
installed version runs it. Prefill is one forward over `depth` tokens; decode is the
difference between generating n + 1 tokens and 1 token, so the prompt's cost cancels.
"""
from __future__ import annotations

import statistics
import time


def available() -> str | None:
    """None when torch (with CUDA) and transformers import; else why not."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return f"not importable ({e.name})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def build(cfg):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                         max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.rms_eps,
                         rope_theta=cfg.rope_base, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# --8<-- [start:peer]
def measure(model, depth: int, runs: int, n_decode: int, cache: str | None) -> dict:
    """{prefill_tok_s, decode_tok_s} medians over `runs`; cache None = dynamic, "static"."""
    import torch

    ids = torch.randint(300, model.config.vocab_size, (1, depth), device="cuda")
    extra = {} if cache is None else {"cache_implementation": cache}

    def generate(n):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, **extra)

    with torch.inference_mode():
        generate(2)  # warm-up: kernels, cache allocation
        prefill = [depth / _timed(lambda: model(ids)) for _ in range(runs)]
        decode = []
        for _ in range(runs):
            one, many = _timed(lambda: generate(1)), _timed(lambda: generate(n_decode + 1))
            decode.append(n_decode / max(many - one, 1e-9))
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "prefill_runs": prefill, "decode_runs": decode}
# --8<-- [end:peer]


def peer_rows(cfg, depths: list[int], runs: int, n_decode: int, log) -> list[dict]:
    why = available()
    if why:
        log(f"peer: transformers {why}; no peer rows")
        return []
    import transformers

    model = build(cfg)
    rows = []
    for cache, name in ((None, "eager bf16"), ("static", "eager bf16, static cache")):
        for depth in depths:
            try:
                m = measure(model, depth, runs, n_decode, cache)
            except Exception as e:  # a path this transformers version does not run: say so
                log(f"peer {name} at {depth}: failed ({type(e).__name__}: {str(e)[:120]})")
                rows.append({"peer": f"transformers {transformers.__version__} {name}", "depth": depth,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
                break
            log(f"peer {name} at {depth}: prefill {m['prefill_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s")
            rows.append({"peer": f"transformers {transformers.__version__} {name}", "depth": depth} | m)
    return rows
