"""The conversation cache: a finished request's KV cells parked in host memory, and put
back when a later request's prompt starts with the same tokens.

A chat client sends the whole conversation every turn, so turn N's prompt starts with
turn N-1's. Without a cache every turn runs its whole prompt through the model again;
with one, a turn restores the cells it shares with a parked conversation and runs only
the rest (`Engine.generate_ids(..., cached=n)`).

What is reused is chosen so that the reply is the reply a cold server gives, byte for
byte. A cell's bytes depend on more than its token and position: the prompt path computes
a chunk of `prefill_chunk` tokens at a time, and a product over 37 rows does not round
exactly as one over 256 (BLAS orders the sums by the shape), nor does a decode step's
one-row product. A cold server runs a prompt in whole chunks from position 0: [0, C),
[C, 2C), ... So the cache parks only the whole chunks of a request's prompt, never the
partial chunk at its end nor the reply's cells (written by decode steps), and a resumed
prefill starts on a chunk boundary. Every reused cell was then computed by the same
chunk, over the same tokens and the same earlier cells, as a cold server computes it.

Where a prompt row's bytes do not depend on the chunk that computed it (the cuda
backend's rows-alone prompt path, engine/prompt_chunk.py), the whole prompt is parked
and a later prompt resumes at any token: the cache's `chunk` is then 1. The reply's
cells are never parked either way: a decode step computes them, not a prompt chunk.

Parking takes `kv.snapshot`; resuming a parked conversation whose cells are not the ones
the engine holds now takes `kv.restore`, which rewrites the host copy (or the resident
pool) and, when the KV is streamed, refills the VRAM ring with `ring_restore`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

FAULTS = ("none", "skip-restore")  # skip-restore: resume without restoring the parked cells


def common_prefix(a, b) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def snapshot_bytes(snap: dict) -> int:
    return sum(a.nbytes for layer in snap["layers"] for a in layer.values())


@dataclass
class Parked:
    ids: tuple  # the tokens whose cells `snap` holds: whole `chunk`s of a prompt
    snap: dict  # kv.snapshot(len(ids)): the cells' bytes in host arrays
    nbytes: int


# --8<-- [start:conversation_cache]
class ConversationCache:
    def __init__(self, kv, chunk: int, budget_bytes: int, fault: str = "none"):
        self.kv, self.chunk, self.budget, self.fault = kv, chunk, budget_bytes, fault
        self.parked: OrderedDict[tuple, Parked] = OrderedDict()  # least recently used first
        self.live: tuple = ()  # tokens whose cells the engine's KV holds now, whole `chunk`s
        self.hits = self.misses = self.restores = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parked.values())

    def resume(self, ids) -> int:
        """Make the KV hold the longest reusable start of prompt `ids`; return how many
        cells it holds (0: run the whole prompt). At least one token is left to run: the
        prefill's last position gives the first reply token's logits."""
        best, n = None, 0
        for p in self.parked.values():
            m = min(common_prefix(p.ids, ids), len(ids) - 1) // self.chunk * self.chunk
            if m > n:
                best, n = p, m
        if best is None:
            self.misses += 1
            self.live = ()  # the prefill about to run writes from cell 0 on
            return 0
        self.hits += 1
        self.parked.move_to_end(best.ids)
        if common_prefix(self.live, best.ids) < n and self.fault != "skip-restore":
            self.kv.restore(best.snap)  # the engine's KV holds another conversation now
            self.restores += 1
        self.live = ()  # the prefill about to run writes from cell n on
        return n

    def park(self, ids):
        """After a request over prompt `ids`: park the whole `chunk`s of its prompt, the
        least recently used conversations leaving while the cache is over its budget."""
        n = len(ids) // self.chunk * self.chunk
        self.live = tuple(ids[:n])
        if n == 0 or self.budget == 0:
            return
        key = self.live
        for other in list(self.parked):
            if common_prefix(other, key) == len(key):  # a parked one holds these cells already
                self.parked.move_to_end(other)
                return
            if common_prefix(other, key) == len(other):  # the same conversation, shorter: replaced
                del self.parked[other]
        snap = self.kv.snapshot(n)
        parked = Parked(key, snap, snapshot_bytes(snap))
        if parked.nbytes > self.budget:
            return
        self.parked[key] = parked
        while self.nbytes > self.budget:
            self.parked.popitem(last=False)
            self.evictions += 1

    def stats(self) -> dict:
        return dict(conversations=len(self.parked), bytes=self.nbytes, budget_bytes=self.budget,
                    hits=self.hits, misses=self.misses, restores=self.restores, evictions=self.evictions)
# --8<-- [end:conversation_cache]
