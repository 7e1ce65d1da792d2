"""Generate with the Python API on the default model, streamed KV, and print the run's stats.

The default model is fetched into $STRATA_NB_HOME on first use. Everything runs on the
CPU with the numpy backend (the kernels' NumPy references).

    python examples/generate.py ["your prompt"] [--max-tokens 48] [--max-context 2048]
"""
import argparse
import sys

from strata_nb import Engine
from strata_nb.settings import SamplingSettings

ap = argparse.ArgumentParser()
ap.add_argument("prompt", nargs="?", default="Write a haiku about a lighthouse.")
ap.add_argument("--kv", default="k8v4", help="fp16, int8, q4_0 or k8v4")
ap.add_argument("--kv-resident", type=int, default=320, help="cells per layer in 'VRAM'; 0 = all")
ap.add_argument("--max-context", type=int, default=2048)
ap.add_argument("--max-tokens", type=int, default=48)
args = ap.parse_args()

eng = Engine.load(kv=args.kv, kv_resident=args.kv_resident, device="cpu", max_context=args.max_context)
ids = eng.prompt_ids(args.prompt)  # the chat template applied, then tokenized
print(f"prompt: {len(ids)} tokens; first ids {ids[:8]}")
print(f"as the model sees it: {eng.tokenizer.decode(ids)!r}\n")

tokens = []
for piece in eng.generate_ids(ids, SamplingSettings(max_tokens=args.max_tokens), on_token=tokens.append):
    sys.stdout.write(piece)  # pieces never split a UTF-8 character
    sys.stdout.flush()

s, c = eng.last_stats, eng.kv.counters
print(f"\n\ngenerated {s.generated_tokens} tokens ({s.finish_reason}); ids {tokens[:8]}...")
print(f"prefill {s.prefill_tok_s:.1f} tok/s, decode {s.decode_tok_s:.1f} tok/s")
print(f"KV counters ({eng.kv.describe()}):")
print(f"  {c.lookups} lookups, {c.misses} misses, hit rate {c.hit_rate:.3f}, "
      f"{c.copies} copies, {c.in_place} read in place")
