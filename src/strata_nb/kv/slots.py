"""Which block is in which VRAM slot: the page table, the ring, the CLOCK-swept slot pool.

This is control state, kept on the host and small (a few hundred ints a layer); the
kernels read the page table, the cache uploads it after each change.

Slots [0, n_ring) are the **ring**: the most recent `--kv-window` cells, mapped statically
(`slot = block % n_ring`, no lookup). Slots [n_ring, n_slots) are the **slot pool** for
older blocks, replaced by a CLOCK (second-chance) sweep.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kv_layout import BLOCK, point


# --8<-- [start:counters]
@dataclass
class StreamCounters:
    lookups: int = 0  # one per distinct selected block per query
    misses: int = 0  # looked-up blocks whose table entry was -1
    copies: int = 0  # missed blocks copied host -> slot
    refills: int = 0  # blocks copied host -> ring when a write resumes in a block the ring had left
    in_place: int = 0  # misses beyond the free slots, read from the host copy in place
    bytes_moved: int = 0  # host -> VRAM bytes: copies and prompt staging
    staged_blocks: int = 0  # blocks staged for prompt chunks
    steps: int = 0  # resolves (one per layer per decode step or verify window)
    per_step: list = field(default_factory=list)  # misses of each resolve

    @property
    def misses_per_step(self) -> float:
        return self.misses / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.lookups if self.lookups else 1.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "per_step"}
        d["hit_rate"] = self.hit_rate
        d["misses_per_step"] = self.misses_per_step
        return d
# --8<-- [end:counters]


# --8<-- [start:slot_table]
class SlotTable:
    """One layer's maps. Invariant: page_table and slot_block are inverse where set."""

    def __init__(self, n_blocks: int, n_ring: int, n_pool: int):
        self.n_ring, self.n_slots = n_ring, n_ring + n_pool
        self.page_table = np.full(n_blocks, -1, np.int32)  # block -> slot, -1 = not in VRAM
        self.slot_block = np.full(self.n_slots, -1, np.int32)  # slot -> block, -1 = free
        self.referenced = np.zeros(self.n_slots, bool)  # CLOCK reference bits (pool slots)
        self.hand = n_ring  # the CLOCK hand sweeps pool slots only
    # --8<-- [end:slot_table]

    def reset(self):
        self.page_table[:] = -1
        self.slot_block[:] = -1
        self.referenced[:] = False
        self.hand = self.n_ring

    def reset_to_ring(self, end_block: int):
        """After a ring restore: nothing mapped but the ring's blocks [end - n_ring, end)."""
        self.reset()
        for b in range(max(0, end_block - self.n_ring), end_block):
            self._point(b, b % self.n_ring)

    def _point(self, block: int, slot: int):
        point(self.page_table, self.slot_block, block, slot)

    # --8<-- [start:map_ring]
    def map_ring(self, first_pos: int, last_pos: int) -> list[tuple[int, int]]:
        """Point the ring at the blocks a write to [first_pos, last_pos] touches.

        Returns (block, slot) pairs to refill from the host copy: blocks that already held
        cells before first_pos (a write that resumes inside a block the ring had left).
        """
        refill = []
        for b in range(first_pos // BLOCK, last_pos // BLOCK + 1):
            slot = b % self.n_ring
            if self.page_table[b] == slot:
                continue
            self._point(b, slot)
            if b * BLOCK < first_pos:
                refill.append((b, slot))
        return refill
    # --8<-- [end:map_ring]

    # --8<-- [start:resolve]
    def resolve(self, blocks: np.ndarray, counters: StreamCounters) -> list[tuple[int, int]]:
        """blocks (n_q, max_sel) int32, -1 padded: count lookups and misses, give each miss a
        slot by CLOCK, re-point the maps; returns the (block, slot) copies to make."""
        used: set[int] = set()  # slots this step reads: never evicted within the step
        copies = []
        misses = 0
        for row in blocks:
            for b in np.unique(row[row >= 0]):
                counters.lookups += 1
                slot = self.page_table[b]
                if slot >= 0:
                    if slot >= self.n_ring:
                        self.referenced[slot] = True  # a hit earns the slot a second chance
                    used.add(int(slot))
                    continue
                misses += 1
                slot = self._victim(used)
                if slot is None:
                    counters.in_place += 1  # no free slot left this step: read the host copy
                    continue
                self._point(int(b), slot)
                used.add(slot)
                copies.append((int(b), slot))
        counters.misses += misses
        counters.steps += 1
        counters.per_step.append(misses)
        return copies

    def _victim(self, used: set[int]) -> int | None:
        """CLOCK: skip referenced slots (clearing their bits) and slots used this step."""
        n_pool = self.n_slots - self.n_ring
        for _ in range(2 * n_pool):
            slot = self.hand
            self.hand = self.n_ring + (self.hand + 1 - self.n_ring) % n_pool
            if slot in used:
                continue
            if self.referenced[slot]:
                self.referenced[slot] = False
                continue
            return slot
        return None
    # --8<-- [end:resolve]

    def check_inverse(self):
        """The two maps are inverse: every set table entry points at a slot that points back."""
        for b in np.flatnonzero(self.page_table >= 0):
            assert self.slot_block[self.page_table[b]] == b, f"block {b} -> slot {self.page_table[b]} not inverse"
        for s in np.flatnonzero(self.slot_block >= 0):
            assert self.page_table[self.slot_block[s]] == s, f"slot {s} -> block {self.slot_block[s]} not inverse"
