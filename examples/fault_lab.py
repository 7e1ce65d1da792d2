"""The missing-mirror lab: greedy decode, streamed at the minimum resident size, with and
without --fault drop-v-mirror (the k8v4 V half passed unfolded, so V never reaches the
host copy). The prompt is the start of the bundled document, ~1,400 tokens by default.

    python examples/fault_lab.py [--chars 6200] [--max-tokens 40] [--kv-window 256]
"""
import argparse
from importlib import resources

from strata_nb import Engine
from strata_nb.kv.plan import StreamPlan
from strata_nb.settings import SamplingSettings

ap = argparse.ArgumentParser()
ap.add_argument("--chars", type=int, default=6200, help="characters of the bundled document in the prompt")
ap.add_argument("--max-tokens", type=int, default=40)
ap.add_argument("--kv-window", type=int, default=256, help="ring cells; the minimum resident size follows")
args = ap.parse_args()

doc = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
prompt = doc[: args.chars] + "\n\nSummarize the text above in two sentences."
minimum = StreamPlan.minimum_cells(args.kv_window)  # the ring plus 4 slot-pool blocks
base = Engine.load(kv="k8v4", kv_resident=minimum, kv_window=args.kv_window, device="cpu", max_context=2048)
ids = base.prompt_ids(prompt)
print(f"prompt: {len(ids)} tokens; {minimum} cells per layer in VRAM, the rest in the host copy\n")

outputs = {}
for fault in ("none", "drop-v-mirror"):
    eng = base if fault == "none" else base.derive(fault=fault)  # shares the weights
    tokens = []
    text = "".join(eng.generate_ids(ids, SamplingSettings(max_tokens=args.max_tokens), on_token=tokens.append))
    outputs[fault] = tokens
    c = eng.kv.counters
    print(f"--fault {fault}: {c.misses} misses, {c.copies} copies, {c.in_place} read in place")
    print(f"  {text.strip()!r}\n")

same = outputs["none"] == outputs["drop-v-mirror"]
print(f"outputs identical: {same}")
print("the host copy's V is all zeros under the fault, so every streamed read of V is wrong" if not same else
      "the prompt fit in VRAM: make it longer than the resident cells to see the fault")
