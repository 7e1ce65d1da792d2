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
from numba import cuda, int32, uint32

from strata_nb.gpu.launch import absent, expect, inline_device, view_bytes
from strata_nb.kernels.dense.gguf_rows import PART, QTYPES, row_bytes

MAX_USED = 8  # K: the experts a token takes, at most
STAGE_LOADS = 8  # words a thread loads before it stores any, staging rows


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


def make_expert_fetch(fetch):
    """expert_part's first step alone (gguf_rows.py: fetch): the part's bytes into row j of
    f and c, for a kernel that fetches several rows before it decodes any."""

    @cuda.jit(device=True)
    def expert_fetch(slot_a, slot_b, host_a, host_b, slot, index, row, blk, p, f, c, j):
        in_slot = slot >= 0
        a, b = (slot_a, slot_b) if in_slot else (host_a, host_b)
        i = slot if in_slot else index
        fetch(a[i], b[i], row, blk, p, f, c, j)

    return expert_fetch


def make_rows_dot(decode, n_rows):
    """rows_dot(f, c, w, xs, acc): n_rows fetched parts (rows 0 .. n_rows - 1 of f and c)
    decoded into w, then each one's dot with the 8 values xs added to acc[j]: the
    arithmetic of a trip that fetched every row's bytes first."""

    @inline_device
    def rows_dot(f, c, w, xs, acc):
        for j in range(n_rows):
            decode(f, c, j, w[j])
        for j in range(n_rows):
            total = acc[j]
            for v in range(PART):
                total += w[j, v] * xs[v]
            acc[j] = total

    return rows_dot
# --8<-- [end:expert_part]


# --8<-- [start:stage_rows]
# A miss read in place is read the way a hit is, a few bytes at a time: a Q4_1 part is a
# 2-byte scale, a 2-byte minimum and 4 bytes of codes, three loads, and each crosses the bus
# as a request of its own. So a thread block whose rows include a missed expert's first
# copies them into shared memory, 4-byte words side by side (a warp's loads are one run of
# 128 bytes, STAGE_LOADS of them in flight a thread), and dequantizes them from there: the
# same bytes, so the same bits.
@cuda.jit(device=True)
def stage_rows(words, index, first, n_rows, row_words, stage, i, s0):
    """Rows first .. first + n_rows - 1 of entry `index` of `words` ((entries, rows *
    row_words) uint32: a host copy or a slot pool as words) into stage[i, s0 ..] (a
    (*, *, >= row_words) uint32 shared array), every thread of the block a strided share.
    The caller waits at a barrier before it reads them."""
    n, base, step = n_rows * row_words, first * row_words, cuda.blockDim.x
    vals = cuda.local.array(STAGE_LOADS, uint32)
    start = cuda.threadIdx.x
    while start < n:
        for u in range(STAGE_LOADS):  # the loads first, all in flight (past the end: the last word again)
            vals[u] = words[index, base + min(start + u * step, n - 1)]
        for u in range(STAGE_LOADS):
            k = int32(start + u * step)
            if k < n:
                s = k // int32(row_words)  # a 32-bit division
                stage[i, s0 + s, k - s * row_words] = vals[u]
        start += STAGE_LOADS * step


def stage_words(dev, a, row_capacity: int):
    """A launch's staging arguments for an (entries, rows, bytes) uint8 stack of expert
    matrices: the stack as (entries, rows * words) uint32, and its words a row. (0, 0)
    and 0 (misses read in place) where a row is not whole words or is longer than a
    staged row holds (`row_capacity` words)."""
    n_bytes = a.shape[2]
    if n_bytes % 4 or n_bytes // 4 > row_capacity:
        return absent((0, 0), np.uint32), np.int32(0)
    words = view_bytes(dev.read(a), np.uint32)
    return words.reshape(a.shape[0], a.shape[1] * (n_bytes // 4)), np.int32(n_bytes // 4)
# --8<-- [end:stage_rows]


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
