"""Stream one layer's KV through a tiny VRAM and watch hits, misses and copies per step.

No model: a KVCache for one layer of the default model's shape (9 query heads, 3 KV heads,
head_dim 64) on the numpy backend, fed random K, V and queries. The ring holds the last
2 blocks, the slot pool 4 more: the minimum for a 32-cell window. A 200-cell prompt goes
in by chunks, then each decode step selects blocks by QSA and resolves them.

    python examples/stream_blocks.py [--steps 12] [--qsa-budget 112]
"""
import argparse

import numpy as np

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kv.cache import KVCache
from strata_nb.model.gguf_file import ModelConfig
from strata_nb.settings import Settings

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--qsa-budget", type=int, default=112, help="cells a query reads; 0 = every block")
args = ap.parse_args()

N_HEADS, N_KV, HD, PROMPT = 9, 3, 64, 200
cfg = ModelConfig("one layer", 1, N_HEADS * HD, 4 * HD, N_HEADS, N_KV, HD, 1e4, 1e-5, 100, 512)
settings = Settings(kv="k8v4", max_context=512, kv_window=32, kv_resident=96, qsa_budget=args.qsa_budget)
be = NumpyBackend()
cache = KVCache(be, cfg, settings)
slots, c = cache.layers[0].slots, cache.counters
print(cache.describe())
print(f"ring: slots 0..{slots.n_ring - 1} (slot = block % {slots.n_ring}); "
      f"slot pool: slots {slots.n_ring}..{slots.n_slots - 1} (CLOCK)")

rng = np.random.default_rng(0)
n = PROMPT + args.steps
k, v = rng.standard_normal((2, n, N_KV, HD), np.float32)
q = rng.standard_normal((n, N_HEADS, HD), np.float32)
for s in range(0, PROMPT, 64):  # the prompt, in chunks: staged, never looked up
    pos = np.arange(s, min(s + 64, PROMPT), dtype=np.int32)
    cache.append(0, pos, k[pos], v[pos], prompt=True)
    cache.attend(0, q[pos], pos, prompt=True)
print(f"prompt: {PROMPT} cells in chunks of 64, {c.staged_blocks} blocks staged from the host copy\n")

print(" pos  selected blocks                 hits miss copy place  pool slots (* = ref bit)  hand")
for pos in range(PROMPT, n):
    p = np.array([pos], np.int32)
    before = dict(lookups=c.lookups, misses=c.misses, copies=c.copies, in_place=c.in_place)
    cache.append(0, p, k[p], v[p], prompt=False)
    chosen = cache.select(cache.layers[0], q[p], p)[0]  # what attend is about to select
    cache.attend(0, q[p], p, prompt=False)
    d = {key: getattr(c, key) - was for key, was in before.items()}
    pool = " ".join(f"b{slots.slot_block[s]}{'*' if slots.referenced[s] else ''}".ljust(4)
                    for s in range(slots.n_ring, slots.n_slots))
    print(f"{pos:4d}  {str(chosen[chosen >= 0].tolist()):<30}  {d['lookups'] - d['misses']:4d} {d['misses']:4d} "
          f"{d['copies']:4d} {d['in_place']:5d}  {pool:<24}  {slots.hand}")

print(f"\ntotal: {c.lookups} lookups, {c.misses} misses, hit rate {c.hit_rate:.2f}, {c.copies} copies, "
      f"{c.in_place} read in place, {c.bytes_moved} bytes moved")
