"""One block of host memory that the conversation cache parks conversations in: a range
per conversation, taken and given back.

A parked conversation of the default model at 4,000 cells is ~94 MB of K/V. Copies between
the GPU and *pinned* host memory run at the bus's speed; from pageable memory the driver
stages them through a pinned buffer of its own, at a fraction of it. But pinning memory
is slow (the kernel locks it page by page: ~80 ms for 94 MB on an H100 host), far too slow
to do at every park. So the cache pins its whole budget once, when it is made, and
conversations take ranges of it: a park copies the cells from the device into its range,
a restore copies them back, both at the bus's speed.

Ranges are placed first fit, in byte order; a given-back range merges with free
neighbours. When no free range fits, the cache gives back its least recently used
conversations until one does (serve/conversations.py), so the budget holds by
construction: the arena *is* the budget.
"""
from __future__ import annotations

import bisect

import numpy as np

from ..kv.snapshot import ALIGN, aligned  # every range starts on a multiple of ALIGN, as a snapshot's fields do


# --8<-- [start:host_arena]
class HostArena:
    def __init__(self, memory: np.ndarray):
        """memory: (nbytes,) uint8 host array (pinned on a GPU) that the ranges cut."""
        self.memory = memory
        self.free: list[list[int]] = [[0, memory.nbytes]] if memory.nbytes else []  # [start, end), by start
        self.taken: dict[int, int] = {}  # start -> end

    @property
    def used(self) -> int:
        return sum(end - start for start, end in self.taken.items())

    def take(self, nbytes: int) -> int | None:
        """The start of a free range of nbytes (rounded up to ALIGN), now taken; None when no
        free range is that long."""
        need = aligned(nbytes)
        for i, (start, end) in enumerate(self.free):
            if end - start >= need:
                if end - start == need:
                    del self.free[i]
                else:
                    self.free[i][0] = start + need
                self.taken[start] = start + need
                return start
        return None

    def give(self, start: int):
        """Give back the range taken at start, merged with the free ranges beside it."""
        end = self.taken.pop(start)
        i = bisect.bisect(self.free, [start, end])
        if i < len(self.free) and self.free[i][0] == end:  # the next free range starts where this ends
            end = self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][1] == start:  # the previous one ends where this starts
            self.free[i - 1][1] = end
        else:
            self.free.insert(i, [start, end])

    def view(self, start: int) -> np.ndarray:
        """The bytes of the range taken at start."""
        return self.memory[start:self.taken[start]]
# --8<-- [end:host_arena]
