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

Parking takes `kv.snapshot` into a range of the cache's arena (serve/host_arena.py: the
whole budget, pinned once on a GPU, so both copies run at the bus's speed); resuming a
parked conversation whose cells are not the ones the engine holds now takes `kv.restore`,
which rewrites the host copy (or the resident pool) and, when the KV is streamed, refills
the VRAM ring with `ring_restore`. When no free range of the arena fits a conversation,
the least recently used ones leave until one does: the budget holds by construction.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import StrataError
from .host_arena import HostArena, aligned

FAULTS = ("none", "skip-restore")  # skip-restore: resume without restoring the parked cells


def common_prefix(a, b) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Parked:
    ids: tuple  # the tokens whose cells `snap` holds: whole `chunk`s of a prompt
    snap: dict  # kv.snapshot(len(ids), into=...): the cells' bytes, in the arena
    start: int  # where its range of the arena starts
    nbytes: int


# --8<-- [start:conversation_cache]
class ConversationCache:
    def __init__(self, kv, chunk: int, budget_bytes: int, fault: str = "none"):
        self.kv, self.chunk, self.budget, self.fault = kv, chunk, budget_bytes, fault
        try:
            memory = kv.parking_memory(budget_bytes) if budget_bytes else np.empty(0, np.uint8)
        except MemoryError:
            raise StrataError(f"cannot reserve {budget_bytes / 2**20:,.0f} MiB of host memory for the conversation "
                              "cache (lower --conversation-cache-mib)") from None
        self.arena = HostArena(memory)
        self.parked: OrderedDict[tuple, Parked] = OrderedDict()  # least recently used first
        self.live: tuple = ()  # tokens whose cells the engine's KV holds now, whole `chunk`s
        self.hits = self.misses = self.restores = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self.arena.used

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
                self._leave(other)
        nbytes = self.kv.snapshot_nbytes(n)
        if aligned(nbytes) > self.arena.memory.nbytes:  # larger than the whole budget
            return
        start = self.arena.take(nbytes)
        while start is None:  # no free range fits: the least recently used leave until one does
            self._leave(next(iter(self.parked)))
            self.evictions += 1
            start = self.arena.take(nbytes)
        snap = self.kv.snapshot(n, into=self.arena.view(start))
        self.parked[key] = Parked(key, snap, start, nbytes)

    def _leave(self, key: tuple):
        self.arena.give(self.parked.pop(key).start)

    def stats(self) -> dict:
        return dict(conversations=len(self.parked), bytes=self.nbytes, budget_bytes=self.budget,
                    hits=self.hits, misses=self.misses, restores=self.restores, evictions=self.evictions)
# --8<-- [end:conversation_cache]
