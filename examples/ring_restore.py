"""Snapshot a streamed cache, scribble over it, restore it: the ring then holds the host copy's bytes.

A restore (the mechanism a conversation cache uses) rewrites the host copy wholesale. VRAM
may still hold the scribbled bytes, so the restore resets the slot table and refills the
ring from the host copy: blocks [end - n_ring, end), each into slot block % n_ring.

    python examples/ring_restore.py
"""
import numpy as np

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kv.cache import KVCache
from strata_nb.model.gguf_file import ModelConfig
from strata_nb.settings import Settings

N_HEADS, N_KV, HD, END = 9, 3, 64, 290
cfg = ModelConfig("one layer", 1, N_HEADS * HD, 4 * HD, N_HEADS, N_KV, HD, 1e4, 1e-5, 100, 512)
cache = KVCache(NumpyBackend(), cfg, Settings(kv="q4_0", max_context=512, kv_window=64, kv_resident=128))
L = cache.layers[0]
n_ring, end_block = L.slots.n_ring, -(-END // 16)
rng = np.random.default_rng(0)


def write(first, last):  # cells [first, last) as one prompt chunk of random K and V
    pos = np.arange(first, last, dtype=np.int32)
    k, v = rng.standard_normal((2, len(pos), N_KV, HD), np.float32)
    cache.append(0, pos, k, v, prompt=True)


def ring_report(label, snap=None):
    print(label)
    for b in range(end_block - n_ring, end_block):
        slot = b % n_ring
        held = int(L.slots.slot_block[slot])  # the block the ring slot holds now
        ring_ok = all(L.pool[f][slot].tobytes() == L.host[f][held].tobytes() for f in L.pool)
        line = (f"  block {b:2d}: page_table {int(L.page_table[b]):2d}; slot {slot} holds block {held:2d}, "
                f"bytes {'==' if ring_ok else '!='} its host copy")
        if snap is not None:
            host_ok = all(L.host[f][b].tobytes() == snap["layers"][0][f][b].tobytes() for f in L.pool)
            line += f", host copy {'==' if host_ok else '!='} snapshot"
        print(line)


write(0, END)
ring_report(f"after writing {END} cells ({end_block} blocks; ring of {n_ring} slots):")
snap = cache.snapshot(END)
print(f"snapshot: {sum(a.nbytes for a in snap['layers'][0].values())} bytes of blocks 0..{end_block - 1}\n")

write(100, 400)  # another conversation overwrites cells 100..399
ring_report("after scribbling over cells 100..399 (the ring followed the writes):", snap)

cache.restore(snap)
print()
ring_report("after restore (host copy rewritten, slot table reset, ring refilled):", snap)
mapped = np.flatnonzero(L.page_table >= 0).tolist()
print(f"  blocks mapped in VRAM: {mapped}; every other block is -1 (read from the host copy)")
