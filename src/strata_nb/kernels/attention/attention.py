"""GQA attention over selected KV blocks, for every KV format, dequantizing as it reads:
the reference (the spec, and the CPU engine's attention), the kernel, and `attention`,
its launcher.

Index legend: Q queries, H query heads, G = H // n_kv query heads per KV head (GQA),
D head_dim, S selected blocks per query, U the union of all queries' selected blocks,
C = U * 16 cells.

Query i, head h attends to the cells of its selected blocks whose position is <= q_pos[i]
(and, in a sliding-window layer, > q_pos[i] - window: the last `window` positions),
through KV head h // G, with scores q.k / sqrt(D) and a softmax over those cells. A block
b is read from the VRAM pool at slot page_table[b] when resident, else in place from the
host copy at b: the bytes are the same either way (the one writer, kv_append_*.py).
The output is in V's stored space: rotated for q4_0 and k8v4, so H (hadamard.py) is
applied once to come back (`rotate_out`). q is rotated by the caller for q4_0 (K is
rotated there), and not for k8v4 (K is not).

The reference is vectorized (prompt chunks of hundreds of queries over thousands of
cells): gather and dequantize the union of the selected blocks once, one masked float32
softmax, matmuls. It depends only on the bytes it reads, so the pool or the host copy
give the same bits. Cells no query in the call can see count as zero.

The kernel: a thread block per (query, head), a thread per output dim, for every pass.
It walks the query's selected blocks in order; `fold_block` reads a block's K and V
columns (kv_readers.py), 16 threads score its 16 cells, and every thread folds them into
an online softmax: a running max m, sum of weights l and weighted V sum, rescaled when
the max grows. A prompt chunk's queries share one row of blocks (shape (1, S)); each
reads it up to its own position, so its bits do not depend on the chunk it comes in.

Tolerance: |kernel - ref| <= ATOL + RTOL * |ref|, for V values of order 1. Both compute
in float32 on the same dequantized values (dequantization is exact); they differ only in
the order of float32 sums (a 64-term dot per score; an online softmax against one max
and one sum; up to S * 16 cells per output) and in exp (CUDA's expf: within 2 ulp).
Each is a few ulp (float32 eps = 1.2e-7), about 1e-6: over 10x headroom.

Selections list distinct blocks; a query that sees no cell gets zeros.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, device_empty, expect, expect_pool, host_or_absent, stream
from strata_nb.kernels.kv.hadamard import N as HADAMARD_N
from strata_nb.kernels.kv.hadamard import hadamard, hadamard_ref
from strata_nb.kernels.kv.kv_readers import READERS, SIDES, dequantize_side, side_arrays
from strata_nb.kv_layout import BLOCK, FORMATS, check_format, pool_arrays

ATOL, RTOL = 2e-5, 1e-4  # the tolerance above
NEG_INF = np.float32(-np.inf)
MAX_HEAD_DIM = 256  # the widest head row the plain kernel's shared arrays hold (Gemma 3's)


def score_scale(head_dim: int) -> np.float32:
    return np.float32(1 / np.sqrt(head_dim))


# --8<-- [start:attention_ref]
def attention_ref(fmt,
                  q,           # (Q, H, D) float32, rotated when fmt == "q4_0"
                  q_pos,       # (Q,) int32: query i sees cells with position <= q_pos[i]
                  blocks,      # (Q, S) int32 selected logical blocks, -1 = padding; (1, S): every query's
                  page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                  pool,        # {field: (n_slots, n_kv, 16, per_head)} as formats.pool_arrays
                  host,        # {field: (n_logical_blocks, n_kv, 16, per_head)}, or None
                  out,         # (Q, H, D) float32, written
                  rotate_out: bool = False,  # apply H to each output head row (a rotated V comes back)
                  ordered: bool | None = None,  # the launcher's hint (rows ascend); a set here
                  rows_alone: bool = False,  # the launcher's: a row never depends on the others here
                  window: int = 0):  # > 0: query i sees only cells after q_pos[i] - window
    check_format(fmt, FORMATS)
    # Unwritten cells may hold any bytes (NaN, inf): masked out below, their warnings are noise
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        o = attend_ref(fmt, q, q_pos, blocks, page_table, pool, host, window)
    out[...] = hadamard_ref(o) if rotate_out else o


def attend_ref(fmt, q, q_pos, blocks, page_table, pool, host, window=0):
    """attention_ref's arithmetic -> the (Q, H, D) float32 output. Queries that share one
    selection (a prompt chunk's (1, S)) are the rows of one product; queries with a
    selection each (a decode step, a verify window) are worked out one at a time, so a
    window's query gets the decode step's bits (product_ref, kernels/dense/matvec.py)."""
    if blocks.shape[0] > 1:
        return np.concatenate([attend_together(fmt, q[i:i + 1], q_pos[i:i + 1], blocks[i:i + 1], page_table, pool,
                                               host, window) for i in range(len(q))])
    return attend_together(fmt, q, q_pos, blocks, page_table, pool, host, window)


def attend_together(fmt, q, q_pos, blocks, page_table, pool, host, window=0):
    """Queries that share a selection (or one query), as the rows of one masked softmax."""
    n_q, n_heads, head_dim = q.shape
    blocks = np.broadcast_to(blocks, (n_q, blocks.shape[1]))  # a (1, S) selection is every query's
    sel = np.unique(blocks[blocks >= 0])  # (U,) sorted, so the order never depends on residency
    kind_k, kind_v = SIDES[fmt]
    k = dequantize_side(kind_k, "k", sel, page_table, pool, host)  # (n_kv, C, D)
    v = dequantize_side(kind_v, "v", sel, page_table, pool, host)  # (n_kv, C, D)
    n_kv, n_cells = k.shape[0], k.shape[1]
    group = n_heads // n_kv

    # --8<-- [start:window_mask]
    # visible[i, c]: cell c is in query i's selection, not after q_pos[i] and, in a
    # sliding-window layer, within its last `window` positions.
    chosen = np.zeros((n_q, len(sel)), bool)
    rows, cols = np.nonzero(blocks >= 0)
    chosen[rows, np.searchsorted(sel, blocks[rows, cols])] = True
    cell_pos = (sel[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)  # (C,)
    visible = np.repeat(chosen, BLOCK, axis=1) & (cell_pos[None, :] <= q_pos[:, None])  # (Q, C)
    if window > 0:
        visible &= cell_pos[None, :] > q_pos[:, None] - window
    # --8<-- [end:window_mask]
    v = np.where(visible.any(axis=0)[None, :, None], v, np.float32(0))  # unseen cells: zero

    # The G query heads of one KV head, for all queries, as the rows of one matmul.
    qg = q.reshape(n_q, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, -1, head_dim)
    scores = (qg @ k.transpose(0, 2, 1)) * score_scale(head_dim)  # (n_kv, Q * G, C)
    scores = scores.reshape(n_kv, n_q, group, n_cells)
    scores = np.where(visible[None, :, None, :], scores, NEG_INF)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(top == NEG_INF, np.float32(0), top)  # a query that sees nothing: exp(-inf) = 0
    p = np.exp(scores - top)  # (n_kv, Q, G, C)
    total = p.sum(axis=-1, keepdims=True)
    mixed = (p.reshape(n_kv, -1, n_cells) @ v).reshape(n_kv, n_q, group, head_dim)
    o = np.where(total > 0, mixed / total, np.float32(0))
    return o.transpose(1, 0, 2, 3).reshape(n_q, n_heads, head_dim)
# --8<-- [end:attention_ref]


# --8<-- [start:attention_kernel]
def make_fold_block(read_k, read_v):
    """For one format (its K and V readers, kv_readers.py): one block of 16 cells folded
    into a query's online softmax. The kernel below and the megakernel both call it."""

    @cuda.jit(device=True)
    def fold_block(b, first, pos, kv_h, d, scale,  # block b (the query sees positions first..pos); dim d
                   page_table, pool_ka, pool_kb, pool_va, pool_vb, host_ka, host_kb, host_va, host_vb,
                   q_s, k_s, scores,  # shared float32: the query's head row (D,), K rows (16, >= D), scores (16,)
                   k_col, v_col,      # local (16,) float32: value d of the block's K and V rows
                   m, l, acc):        # the running max, sum of weights and weighted V sum (dim d)
        """-> m, l, acc with the block's cells in. Every thread calls it (it waits at barriers)."""
        slot = page_table[b]
        if slot >= 0:  # resident: its VRAM slot; else in place from the host copy
            read_k(pool_ka, pool_kb, slot, kv_h, d, k_col)
            read_v(pool_va, pool_vb, slot, kv_h, d, v_col)
        else:
            read_k(host_ka, host_kb, b, kv_h, d, k_col)
            read_v(host_va, host_vb, b, kv_h, d, v_col)
        for c in range(BLOCK):
            k_s[c, d] = k_col[c]
        cuda.syncthreads()  # the block's K rows (and q) are in
        if d < BLOCK and first <= b * BLOCK + d <= pos:  # thread c scores cell c, if the query sees it
            dot = float32(0.0)
            for j in range(q_s.shape[0]):
                dot += q_s[j] * k_s[d, j]
            scores[d] = dot * scale
        cuda.syncthreads()  # the scores are in
        # Only the cells the query sees: those after it (unwritten, maybe NaN) or before its window never count
        for c in range(max(0, first - b * BLOCK), min(BLOCK, pos - b * BLOCK + 1)):
            m_new = max(m, scores[c])
            rescale = math.exp(m - m_new)  # exp(-inf) = 0 at the first cell
            p = math.exp(scores[c] - m_new)
            l = l * rescale + p
            acc = acc * rescale + p * v_col[c]
            m = m_new
        cuda.syncthreads()  # every thread is done with k_s and scores before the next block
        return m, l, acc

    return fold_block


def make_attention_kernel(fold_block):  # the kernel for one format
    @cuda.jit(cache=True)
    def attention_kernel(q, q_pos,    # (Q, H, D) float32; (Q,) int32
                         blocks,      # (Q, S) int32, -1 = padding; or (1, S), every query's
                         page_table, scale,  # (n_logical_blocks,) int32; float32 1 / sqrt(D)
                         window,      # int32: > 0, the query sees only cells after q_pos - window
                         pool_ka, pool_kb, pool_va, pool_vb,  # K and V of the pool, by slot
                         host_ka, host_kb, host_va, host_vb,  # the same by logical block, or (0, ...)
                         out):        # (Q, H, D) float32, written
        i, h, d = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x  # query, head, this thread's dim
        kv_h = h // (q.shape[1] // pool_ka.shape[1])  # GQA: consecutive heads share a KV head
        row = i if blocks.shape[0] == q.shape[0] else 0  # a (1, S) row is every query's
        pos = q_pos[i]
        first = pos - window + 1 if window > 0 else 0  # the first position the query sees
        q_s = cuda.shared.array(MAX_HEAD_DIM, float32)  # the query's head row
        k_s = cuda.shared.array((BLOCK, MAX_HEAD_DIM), float32)  # a block's 16 K rows
        scores = cuda.shared.array(BLOCK, float32)  # their scores
        k_col = cuda.local.array(BLOCK, float32)  # value d of the 16 K rows
        v_col = cuda.local.array(BLOCK, float32)  # value d of the 16 V rows
        q_s[d] = q[i, h, d]
        m, l, acc = NEG_INF, float32(0.0), float32(0.0)  # running max, sum of weights, weighted V sum
        for s in range(blocks.shape[1]):
            b = blocks[row, s]
            if b < 0 or b * BLOCK > pos or (b + 1) * BLOCK <= first:
                continue  # padding, or a block wholly after the query or before its window: alike for every thread
            m, l, acc = fold_block(b, first, pos, kv_h, d, scale, page_table, pool_ka, pool_kb, pool_va, pool_vb,
                                   host_ka, host_kb, host_va, host_vb, q_s[:q.shape[2]], k_s, scores, k_col, v_col, m, l, acc)
        out[i, h, d] = acc / l if l > 0 else float32(0.0)  # no cell seen: 0, as the reference

    return attention_kernel


FOLD_BLOCKS = {fmt: make_fold_block(READERS[k], READERS[v]) for fmt, (k, v) in SIDES.items()}
ATTENTION_KERNELS = {fmt: make_attention_kernel(fold) for fmt, fold in FOLD_BLOCKS.items()}
# --8<-- [end:attention_kernel]


def check_attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out):
    """attention's checks; returns n_kv and the host copy's arrays (size 0 where absent)."""
    check_format(fmt, FORMATS)
    expect("q", q, np.float32, (None, None, None))
    n_q, n_heads, head_dim = q.shape
    expect("q_pos", q_pos, np.int32, (n_q,))
    expect("blocks", blocks, np.int32, (None, None))
    assert blocks.shape[0] in (1, n_q), f"blocks has {blocks.shape[0]} rows for {n_q} queries (1 = shared)"
    expect("page_table", page_table, np.int32, (None,))
    expect("out", out, np.float32, (n_q, n_heads, head_dim))
    specs = pool_arrays(fmt, head_dim)
    n_kv = pool[specs[0].field].shape[1]
    assert n_heads % n_kv == 0, f"{n_heads} query heads do not share {n_kv} KV heads evenly"
    assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}, the shared tiles' width"
    assert not rotate_out or head_dim % HADAMARD_N == 0, f"head_dim {head_dim} is not a multiple of {HADAMARD_N}"
    for spec in specs:
        expect_pool(spec.field, pool[spec.field], spec, n_kv)
    return n_kv, {s.field: host_or_absent(f"host {s.field}", (host or {}).get(s.field, np.empty(0)), s, n_kv)
                  for s in specs}


def attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out: bool = False,
              ordered: bool | None = None, rows_alone: bool = False, window: int = 0):
    """Like attention_ref, on the device; NumPy arguments are moved (out written back).
    A thread block per (query, head), a thread per dim; then H on the output where asked.
    ordered, rows_alone: as attention_ref takes them. This kernel reads any order, and a
    query's bits never depend on the other queries of its launch."""
    n_kv, host = check_attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out)
    n_q, n_heads, head_dim = q.shape
    assert head_dim >= BLOCK, f"head_dim {head_dim} < {BLOCK}: a thread per dim scores the block's cells"
    if n_q == 0:
        return
    kind_k, kind_v = SIDES[fmt]
    with DeviceArgs() as dev:
        sides = (*side_arrays(kind_k, "k", pool, dev), *side_arrays(kind_v, "v", pool, dev),
                 *side_arrays(kind_k, "k", host, dev), *side_arrays(kind_v, "v", host, dev))
        mixed = device_empty(q.shape, np.float32) if rotate_out else dev.write(out)
        ATTENTION_KERNELS[fmt][(n_q, n_heads), head_dim, stream()](
            dev.read(q), dev.read(q_pos), dev.read(blocks), dev.read(page_table), score_scale(head_dim),
            np.int32(window), *sides, mixed)
        if rotate_out:
            hadamard(mixed, out=dev.write(out))
