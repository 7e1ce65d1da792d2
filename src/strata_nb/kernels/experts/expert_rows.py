"""Where an expert's weight rows are read from: its VRAM slot, or the host copy.

Every expert's GGUF rows sit in the host copy (pinned, device-mapped memory), indexed by
`layer * E + e`; some also sit in one of the N VRAM slots of the slot pool. The residency
table says which: `res[layer * E + e]` is the slot, or -1. The expert kernels look an
expert up once and then read its rows from wherever it is, the host copy in place over
the bus (a miss) or the slot at HBM speed (a hit), through the same dequantizer. The
bytes are the same either way, so the result does not depend on where they came from:
that is what lets any cache size give output identical to all-resident.

Index legend: L layers, E experts a layer, N slots, rows and bytes of one expert matrix.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import expect, view_bytes
from strata_nb.kernels.dense.gguf_rows import QTYPES, row_bytes

MAX_USED = 8  # K: the experts a token takes, at most


# --8<-- [start:expert_part]
def make_expert_part(part):
    """The dequantizer `part` (gguf_rows.py), reading row `row` of expert `index`
    (= layer * E + e) from slot `slot` when it has one (slot >= 0), else from the host copy."""

    @cuda.jit(device=True)
    def expert_part(slot_a, slot_b,  # (N, rows, *) two views of the slot pool's bytes
                    host_a, host_b,  # (L * E, rows, *) two views of the host copy's bytes
                    slot, index, row, blk, p, w):
        # which memory is a select, not a branch, so a caller's loads of several parts can
        # all go out before the first is used (a load after a branch waits for the work
        # before it)
        in_slot = slot >= 0
        a, b = (slot_a, slot_b) if in_slot else (host_a, host_b)
        i = slot if in_slot else index
        part(a[i], b[i], row, blk, p, w)

    return expert_part
# --8<-- [end:expert_part]


def expert_views(name: str, a, qtype: str, rows: int, n_in: int):
    """Check an (n, rows, bytes) uint8 stack of expert matrices; its two dequantizer views."""
    expect(name, a, np.uint8, (None, rows, row_bytes(qtype, n_in)))
    _, view_a, view_b, _ = QTYPES[qtype]
    return view_bytes(a, view_a), view_bytes(a, view_b)


def expect_table(res, at: int, n_expert: int = 1, **counters):
    """The residency table (L * E,) int32, with room for this layer's E entries from `at`;
    and any usage counters (route's lookups and hits), shaped as it."""
    expect("res", res, np.int32, (None,))
    for name, a in counters.items():
        expect(name, a, np.int32, (res.shape[0],))
    assert 0 <= at and at + n_expert <= res.shape[0], f"entries {at}..{at + n_expert} are outside res {res.shape}"
