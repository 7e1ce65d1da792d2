"""The expert cache at work on a tiny random-weight MoE model: any number of VRAM slots gives
the logits of every expert resident, bit for bit, and the negative control breaks that.

A dense 2-layer model is written, then `moefy` makes it an MoE of 8 full copies of its
FFN, each token routed to 2 of them by a random router: 2 layers x 8 = 16 experts, some
chosen far more often than others. The same greedy decode then runs with 0, 2, 6 and all
16 experts in slots. For each size the script prints the cache's hit rate, the experts
copied into slots (and how many of those copies were swaps, evicting another expert), and
whether the logits and tokens equal the all-resident run's. Last, the same 6-slot run with
`fault="expert-early-resident"`: each expert's entry in the residency table points at its
slot before the copy has landed, so a pass reads a slot that still holds another expert's
weights (or zeros), and the logits move. This random model's greedy pick beats the
runner-up by a wide margin at every step, so its tokens stay the same: a check on tokens
alone would miss the fault, which is why the parity tests compare logits.

The numpy backend runs it, with no model download. On the cuda backend the same settings
are `--expert-cache N` and `--fault expert-early-resident`.

    python examples/expert_cache.py
"""
import shutil
import tempfile
from pathlib import Path

import numpy as np

from strata_nb import Engine
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf

PROMPT = "an expert cache"
STEPS = 24  # greedy decode steps after the prompt


def decode(path, slots, fault="none"):
    """Greedy decode with `slots` experts in slots -> (logits of every pass, tokens, stats)."""
    eng = Engine.load(model=str(path), device="cpu", max_context=128, expert_cache=slots, adapt_every=2,
                      fault=fault)
    ids = eng.tokenize(PROMPT)
    logits = [eng.prefill(ids)]
    tokens = [int(np.argmax(logits[-1]))]
    for pos in range(len(ids), len(ids) + STEPS):
        logits.append(eng.decode_one_token(tokens[-1], pos))
        tokens.append(int(np.argmax(logits[-1])))
    return np.stack(logits), tokens, eng.weights.experts


folder = Path(tempfile.mkdtemp())
dense_path = write_synthetic_gguf(folder / "dense.gguf", d_ff=256, seed=3)
copies_path = moefy(dense_path, folder / "copies-e8k2.gguf", "copies", experts=8, used=2, seed=5)

want, want_tokens, cache = decode(copies_path, "auto")  # auto on the CPU: every expert resident
every = cache.n_layers * cache.n_expert
print(f"{cache.n_layers} layers x {cache.n_expert} experts = {every}, {cache.k} used a token; "
      f"{STEPS} greedy steps after a prompt")
print(f"{'slots':>5}  {'hit rate':>8}  {'copies':>6}  {'swaps':>5}  same logits  same tokens")
every_size_equal = True
for slots in (0, 2, 6, every):
    logits, tokens, cache = decode(copies_path, slots)
    s, same = cache.stats(), np.array_equal(logits, want)
    every_size_equal &= same and tokens == want_tokens
    print(f"{slots:>5}  {s.hit_rate:>8.3f}  {s.copies:>6}  {s.swaps:>5}  {same!s:>11}  {tokens == want_tokens!s:>11}")

logits, tokens, cache = decode(copies_path, 6, fault="expert-early-resident")
caught = not np.array_equal(logits, want)
top2 = np.sort(want, axis=1)[:, -2:]  # each pass's two largest logits
print(f"\nfault expert-early-resident, 6 slots: {cache.stats().copies} copies, each marked resident before it lands")
print(f"  same logits: {not caught}; largest logit difference {np.abs(logits - want).max():.2f} "
      f"(largest logit {np.abs(want).max():.2f})")
print(f"  same tokens: {tokens == want_tokens} (the greedy pick leads the runner-up by at least "
      f"{(top2[:, 1] - top2[:, 0]).min():.2f} at every step, so only the logits show it)")
print(f"\nevery cache size gives the all-resident logits: {every_size_equal}; the fault is caught: {caught}")
shutil.rmtree(folder)
