"""How far two runs of the same prompt drift apart in the KV cache, layer by layer.

    python tools/kv_divergence.py --kv q4_0 --depth 8157                  # numpy, chunk 2048 vs 256
    STRATA_NB_GPU=1 python tools/kv_divergence.py --kv q4_0 --against cuda  # numpy vs the cuda backend

Both runs prefill `--depth` tokens of the bundled document; then, for every layer, the
fraction of the cache's K/V bytes (the host copy when streaming) that differ, and the
first logits' largest difference. A writer bug (a dropped host-copy write, a garbled
block) shows in layer 0, whose K/V depend on nothing but the embedding and one matrix
product. Rounding alone leaves layer 0 equal up to rare ties; in a quantized cache a
flipped code can then spread through later layers (the bench's output check measures
that spread: bench/check.py). Reads the default model unless --model is given.
"""
from __future__ import annotations

import argparse
from importlib import resources

import numpy as np

from strata_nb.bench.check import byte_differences
from strata_nb.bench.run import Config, prompt_of
from strata_nb.engine.engine import Engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv", default="q4_0")
    ap.add_argument("--depth", type=int, default=8157)
    ap.add_argument("--streamed", action="store_true", help="the bench's streamed mode (QSA 1024, minimum resident)")
    ap.add_argument("--against", choices=["numpy", "cuda"], default="numpy")
    ap.add_argument("--chunks", default="2048,256", help="prefill chunks of the first and second run")
    args = ap.parse_args()
    chunk_a, chunk_b = (int(c) for c in args.chunks.split(","))
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    base = Engine.load(model=args.model, device="cpu", max_context=max(args.depth + 1, 1024))
    mode = Config(args.kv, args.streamed, args.depth).settings(base.settings.kv_window)
    prompt = prompt_of(base, text, args.depth)
    a = base.derive(prefill_chunk=chunk_a, **mode)
    other = base if args.against == "numpy" else Engine.load(model=args.model, device="cuda",
                                                              max_context=base.settings.max_context)
    b = other.derive(prefill_chunk=chunk_b, **mode)
    la, lb = a.prefill(prompt), b.prefill(prompt)
    sa, sb = a.kv.snapshot(args.depth), b.kv.snapshot(args.depth)
    print(f"{args.kv} {'streamed' if args.streamed else 'resident'}, {args.depth} tokens: numpy chunk {chunk_a} "
          f"vs {args.against} chunk {chunk_b}")
    print(f"first logits: max |difference| {np.abs(la - lb).max():.3f}, top {int(np.argmax(la))} vs {int(np.argmax(lb))}")
    print("layer  " + "  ".join(f"{f:>8}" for f in byte_differences(sa["layers"][0], sb["layers"][0], args.depth)))
    for i, (x, y) in enumerate(zip(sa["layers"], sb["layers"])):
        print(f"{i:>5}  " + "  ".join(f"{v:8.5f}" for v in byte_differences(x, y, args.depth).values()), flush=True)


if __name__ == "__main__":
    main()
