"""How many of a layer's blocks VRAM holds when the KV cache streams: the ring and the
slot pool (`--kv-resident`, `--kv-window`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from ..kv_layout import BLOCK

MIN_POOL_BLOCKS = 4  # slot-pool blocks beyond the ring at the minimum resident size


# --8<-- [start:stream_plan]
@dataclass(frozen=True)
class StreamPlan:
    n_blocks: int  # blocks per layer in the host copy (the whole context)
    n_ring: int  # ring slots: the recent window
    n_pool: int  # slot-pool slots: older blocks

    @property
    def resident_cells(self) -> int:
        return (self.n_ring + self.n_pool) * BLOCK

    @staticmethod
    def minimum_cells(kv_window: int) -> int:
        return kv_window + MIN_POOL_BLOCKS * BLOCK

    @classmethod
    def from_settings(cls, s, n_blocks: int) -> "StreamPlan | None":
        """None = fully resident. Clamps --kv-resident up to its minimum and says so."""
        if s.kv_resident == 0:
            return None
        minimum = cls.minimum_cells(s.kv_window)
        cells = s.kv_resident
        if cells < minimum:
            print(f"strata-nb: --kv-resident {cells} is below the minimum {minimum} (--kv-window {s.kv_window} "
                  f"+ {MIN_POOL_BLOCKS} slot-pool blocks); using {minimum}", file=sys.stderr)
            cells = minimum
        if cells >= n_blocks * BLOCK:
            print(f"strata-nb: --kv-resident {cells} holds the whole context of {n_blocks * BLOCK} cells; "
                  "running fully resident", file=sys.stderr)
            return None
        n_ring = s.kv_window // BLOCK
        return cls(n_blocks, n_ring, cells // BLOCK - n_ring)
# --8<-- [end:stream_plan]
