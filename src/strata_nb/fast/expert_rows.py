"""Plain twin: kernels/experts/expert_rows.py (make_expert_part). What the fast expert
kernels add to reading an expert's rows: a part's bytes fetched for several rows before
any is decoded, and a missed expert's rows staged through shared memory rather than read
in place, a few bytes a request, over the bus.

Index legend: L layers, E experts a layer, N slots, rows and bytes of one expert matrix.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, uint32

from strata_nb.gpu.launch import absent, inline_device, view_bytes
from strata_nb.kernels.dense.gguf_rows import PART

STAGE_LOADS = 8  # words a thread loads before it stores any, staging rows


# --8<-- [start:expert_fetch]
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
# --8<-- [end:expert_fetch]


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
