"""GQA attention over selected KV blocks, for every KV format, dequantizing as it reads.

Index legend: Q queries, H query heads, G = H // n_kv query heads per KV head (GQA),
D head_dim, S selected blocks per query, U the union of all queries' selected blocks,
C = U * 16 cells.

Query i, head h attends to the cells of its selected blocks whose position is <= q_pos[i],
through KV head h // G, with scores q.k / sqrt(D) and a softmax over those cells. A block
b is read from the VRAM pool at slot page_table[b] when resident, else in place from the
host copy at b: the bytes are the same either way (the one writer, kv_append_*.py).
The output is in V's stored space: rotated for q4_0 and k8v4, so the caller applies H
(hadamard.py) once to come back. q is rotated by the caller for q4_0 (K is rotated
there), and not for k8v4 (K is not).

The reference is also the engine's CPU path, called for prefill chunks of 256 queries
over up to 8192 cells, so it is vectorized: gather and dequantize the union of the
selected blocks once, one masked float32 softmax, matmuls. Its result depends only on the
bytes it reads, so reading from the pool or from the host copy gives the same bits.
Cells that no query in the call can see (the unwritten tail of the newest block) count as
zero, as they do in the kernel, which never reads them.

Kernel vs reference tolerance: |kernel - ref| <= ATOL + RTOL * |ref|, for V values of
order 1. Both compute in float32 on identical dequantized values (dequantization is exact
in both); they differ only in the order of float32 sums (a 64-term dot product per score,
the kernel's block-by-block online softmax within a split of 4 blocks and the merge of
the splits, against one max and one sum, a sum over up to S * 16 cells per output) and in exp (CUDA's expf is within 2 ulp). Each of those is a
few ulp (float32 eps = 1.2e-7) of the values summed, so errors are around 1e-6 (the
tests see at most 1.1e-6); the tolerance leaves over 10x headroom.

Selections list distinct blocks; a query that sees no cell gets zeros.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32

from strata_nb.kernels.launch import DeviceArgs, device_empty, expect, expect_pool, host_or_absent, stream, view_bytes
from strata_nb.kernels.attention_step import attention_step
from strata_nb.kernels.kv_readers import READERS, SIDES
from strata_nb.kernels.hadamard import N as HADAMARD_N
from strata_nb.kernels.hadamard import hadamard, hadamard_ref
from strata_nb.kernels.quant_int8 import dequantize_int8_ref
from strata_nb.kernels.quant_q4_0 import dequantize_q4_0_ref
from strata_nb.kv.formats import BLOCK, FORMATS, check_format, pool_arrays

ATOL = 2e-5
RTOL = 1e-4

NEG_INF = np.float32(-np.inf)
MAX_HEAD_DIM = 128  # shared tiles are sized at compile time: 2 x 16 x 128 floats = 16 KiB
K_STRIDE = MAX_HEAD_DIM + 1  # the K tile's row stride: row c starts c banks further on
# Rows (query, head) a thread block attends for, and their q and acc values: 16 queries x
# 3 heads x 64 dims for the default model. Shared memory then holds 24 KiB of rows, 16 KiB
# of K/V tiles and 3 KiB of weights, under the 48 KiB a block may have statically.
MAX_TILE_ROWS = 48
TILE_VALUES = 48 * 64
# Selected blocks per thread block of the tiled kernel, at least (4 = 64 cells). Under the
# simulator every thread is a Python thread, so one split covers up to 64 blocks there
# and a thread block has one warp; tests pass per_split=1 to exercise many splits.
BLOCKS_PER_SPLIT = 64 if config.ENABLE_CUDASIM else 4
THREADS = 32 if config.ENABLE_CUDASIM else 128
# A prompt chunk's splits: about this many thread blocks in all (a few waves of the GPU),
# so a 2,048-query chunk does not keep (query, head, split) partial sums for 4-block splits
PROMPT_THREAD_BLOCKS = 2048
MAX_COMBINE_GROUPS = 16  # thread rows of the combine kernel, each summing every 16th split
# Under the simulator every thread is a Python thread: one row there (tests pass 4 to cover it)
COMBINE_GROUPS = 1 if config.ENABLE_CUDASIM else MAX_COMBINE_GROUPS


def score_scale(head_dim: int) -> np.float32:
    return np.float32(1 / np.sqrt(head_dim))


# --8<-- [start:attention_ref]
def side_fields(kind: str, side: str) -> tuple[str, ...]:
    """The pool fields one side ("k" or "v") of a format is stored in."""
    return {"float": (side,), "int8": (f"{side}_q", f"{side}_s"), "q4_0": (f"{side}_q4",)}[kind]


def gather_blocks(field, sel, page_table, pool, host):
    """Blocks `sel` of one field, each from its slot if resident, else from the host copy."""
    slots = page_table[sel]
    resident = slots >= 0
    out = np.empty((len(sel), *pool[field].shape[1:]), pool[field].dtype)  # (U, n_kv, 16, per_head)
    out[resident] = pool[field][slots[resident]]
    if not resident.all():
        assert host is not None, "a selected block is not resident and there is no host copy"
        out[~resident] = host[field][sel[~resident]]
    return out


def dequantize_side(kind, side, sel, page_table, pool, host):
    """(n_kv, C, D) float32: one side of the selected blocks, cells in block order."""
    raw = [gather_blocks(f, sel, page_table, pool, host) for f in side_fields(kind, side)]
    values = {"float": lambda: raw[0].astype(np.float32),
              "int8": lambda: dequantize_int8_ref(*raw),
              "q4_0": lambda: dequantize_q4_0_ref(raw[0])}[kind]()  # (U, n_kv, 16, D)
    return values.transpose(1, 0, 2, 3).reshape(values.shape[1], -1, values.shape[3])


def attention_ref(fmt,
                  q,           # (Q, H, D) float32, rotated when fmt == "q4_0"
                  q_pos,       # (Q,) int32: query i sees cells with position <= q_pos[i]
                  blocks,      # (Q, S) int32 selected logical blocks, -1 = padding
                  page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                  pool,        # {field: (n_slots, n_kv, 16, per_head)} as formats.pool_arrays
                  host,        # {field: (n_logical_blocks, n_kv, 16, per_head)}, or None
                  out,         # (Q, H, D) float32, written
                  rotate_out: bool = False):  # apply H to each output head row (a rotated V comes back)
    check_format(fmt, FORMATS)
    # Unwritten cells may hold any bytes (NaN, inf, huge): they are masked out below, so
    # the warnings their arithmetic raises on the way are noise.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        o = attend_ref(fmt, q, q_pos, blocks, page_table, pool, host)
    out[...] = hadamard_ref(o) if rotate_out else o


def attend_ref(fmt, q, q_pos, blocks, page_table, pool, host):
    """attention_ref's arithmetic; returns the (Q, H, D) float32 output."""
    n_q, n_heads, head_dim = q.shape
    sel = np.unique(blocks[blocks >= 0])  # (U,) sorted, so the order never depends on residency
    kind_k, kind_v = SIDES[fmt]
    k = dequantize_side(kind_k, "k", sel, page_table, pool, host)  # (n_kv, C, D)
    v = dequantize_side(kind_v, "v", sel, page_table, pool, host)  # (n_kv, C, D)
    n_kv, n_cells = k.shape[0], k.shape[1]
    group = n_heads // n_kv

    # visible[i, c]: cell c is in query i's selection and not after q_pos[i].
    chosen = np.zeros((n_q, len(sel)), bool)
    rows, cols = np.nonzero(blocks >= 0)
    chosen[rows, np.searchsorted(sel, blocks[rows, cols])] = True
    cell_pos = (sel[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)  # (C,)
    visible = np.repeat(chosen, BLOCK, axis=1) & (cell_pos[None, :] <= q_pos[:, None])  # (Q, C)
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
def make_attention_kernel(read_k, read_v):
    """A kernel for one format, given how it reads K and V values. Numba compiles each."""

    @cuda.jit
    def attention_kernel(q,           # (Q, H, D) float32
                         q_pos,       # (Q,) int32
                         blocks,      # (Q, S) int32, -1 = padding
                         page_table,  # (n_logical_blocks,) int32
                         scale,       # float32: 1 / sqrt(D)
                         per_split,   # int32: selected blocks per split
                         tile,        # int32: queries per thread block (their columns agree)
                         pool_ka, pool_kb, pool_va, pool_vb,  # K and V of the pool, by slot
                         host_ka, host_kb, host_va, host_vb,  # the same by logical block, or (0, ...)
                         part_m, part_l,  # (Q, H, n_splits) float32, written: each split's max and sum
                         part_acc):   # (Q, H, n_splits, D) float32, written: its weighted V sum
        # One thread block per (tile of queries, KV head, split): a split is `per_split`
        # consecutive columns of the selection, so a long context spreads over many blocks
        # of the GPU, and the G query heads of the KV head, for every query of the tile,
        # are the block's rows: each K/V block is read from memory once for all of them.
        # Per selected block: the threads unpack its 16 K and V rows into shared memory
        # (thread u reads value u of 16 rows: neighbouring threads, neighbouring bytes),
        # score the (row, cell) pairs, fold each row's 16 scores into its online softmax
        # (a running max m, sum l, rescaled whenever a block raises the max), then update
        # the rows' weighted V sums, acc. attention_combine_kernel merges the splits.
        q0, kv_h, split = cuda.blockIdx.x * tile, cuda.blockIdx.y, cuda.blockIdx.z
        t, n_threads = cuda.threadIdx.x, cuda.blockDim.x
        head_dim = q.shape[2]
        group = q.shape[1] // pool_ka.shape[1]  # consecutive query heads share a KV head
        n_tile = min(tile, q.shape[0] - q0)
        rows = n_tile * group  # row r: query q0 + r // group, head kv_h * group + r % group
        q_rows = cuda.shared.array(TILE_VALUES, float32)  # q_rows[r * D + j]
        acc = cuda.shared.array(TILE_VALUES, float32)  # acc[r * D + d]
        # K_STRIDE: a warp scoring 16 cells reads 16 rows at once, each from its own bank
        k_tile = cuda.shared.array((BLOCK, K_STRIDE), float32)
        v_tile = cuda.shared.array((BLOCK, MAX_HEAD_DIM), float32)
        weights = cuda.shared.array((MAX_TILE_ROWS, BLOCK), float32)  # scores, then exp weights
        m = cuda.shared.array(MAX_TILE_ROWS, float32)
        l = cuda.shared.array(MAX_TILE_ROWS, float32)
        rescale = cuda.shared.array(MAX_TILE_ROWS, float32)
        column = cuda.local.array(BLOCK, float32)  # value u of the block's 16 K (or V) rows
        for e in range(t, rows * head_dim, n_threads):
            r, j = e // head_dim, e % head_dim
            q_rows[e] = q[q0 + r // group, kv_h * group + r % group, j]
            acc[e] = float32(0.0)
        for r in range(t, rows, n_threads):
            m[r], l[r] = NEG_INF, float32(0.0)
        last = -1  # the tile's last visible position
        for i in range(q0, q0 + n_tile):
            last = max(last, q_pos[i])
        first = split * per_split
        for s in range(first, min(first + per_split, blocks.shape[1])):
            b = -1  # the tile's block in column s: the launcher checked that its queries agree
            for i in range(q0, q0 + n_tile):
                b = max(b, blocks[i, s])
            # padding, or a block wholly after the tile (a decode step replayed from a graph
            # lists every block of the context): the same for every thread, so none skips a
            # barrier alone
            if b < 0 or b * BLOCK > last:
                continue
            slot = page_table[b]
            r = slot if slot >= 0 else b
            ka, kb = (pool_ka, pool_kb) if slot >= 0 else (host_ka, host_kb)
            va, vb = (pool_va, pool_vb) if slot >= 0 else (host_va, host_vb)
            # All 16 cells, even those after the queries (unwritten bytes, maybe NaN): their
            # scores are masked below and their V is never weighted. A column is loaded
            # into registers first, with no store between the loads, so they are in flight
            # together (a store to shared memory could alias a load, so it would wait).
            for u in range(t, 2 * head_dim, n_threads):
                if u < head_dim:
                    read_k(ka, kb, r, kv_h, u, column)
                    for c in range(BLOCK):
                        k_tile[c, u] = column[c]
                else:
                    read_v(va, vb, r, kv_h, u - head_dim, column)
                    for c in range(BLOCK):
                        v_tile[c, u - head_dim] = column[c]
            cuda.syncthreads()  # the tiles are complete before anyone reads them

            for e in range(t, rows * BLOCK, n_threads):  # score (row, cell) pairs
                r, c = e // BLOCK, e % BLOCK
                i = q0 + r // group
                if blocks[i, s] == b and b * BLOCK + c <= q_pos[i]:
                    dot = float32(0.0)
                    for j in range(head_dim):
                        dot += q_rows[r * head_dim + j] * k_tile[c, j]
                    weights[r, c] = dot * scale
                else:
                    weights[r, c] = NEG_INF
            cuda.syncthreads()  # all scores written before the softmax reads them

            for r in range(t, rows, n_threads):  # each row's softmax, one thread per row
                block_max = NEG_INF
                for c in range(BLOCK):
                    block_max = max(block_max, weights[r, c])
                if block_max > NEG_INF:
                    m_new = max(m[r], block_max)
                    rescale[r] = math.exp(m[r] - m_new)  # l and acc were summed against the old max
                    total = l[r] * rescale[r]
                    for c in range(BLOCK):
                        if weights[r, c] > NEG_INF:
                            weights[r, c] = math.exp(weights[r, c] - m_new)
                            total += weights[r, c]
                        else:
                            weights[r, c] = float32(-1.0)  # masked: its V is never read
                    l[r], m[r] = total, m_new
                else:  # the row sees no cell of this block
                    rescale[r] = float32(1.0)
                    for c in range(BLOCK):
                        weights[r, c] = float32(-1.0)
            cuda.syncthreads()  # weights and rescale factors ready

            for e in range(t, rows * head_dim, n_threads):
                r, d = e // head_dim, e % head_dim
                total = acc[e] * rescale[r]
                for c in range(BLOCK):
                    if weights[r, c] >= 0:  # masked cells may hold NaN: 0 * NaN is NaN
                        total += weights[r, c] * v_tile[c, d]
                acc[e] = total
            cuda.syncthreads()  # done with the tiles and weights before the next block
        for e in range(t, rows * head_dim, n_threads):
            r, d = e // head_dim, e % head_dim
            part_acc[q0 + r // group, kv_h * group + r % group, split, d] = acc[e]
        for r in range(t, rows, n_threads):
            part_m[q0 + r // group, kv_h * group + r % group, split] = m[r]
            part_l[q0 + r // group, kv_h * group + r % group, split] = l[r]

    return attention_kernel


ATTENTION_KERNELS = {fmt: make_attention_kernel(READERS[k], READERS[v]) for fmt, (k, v) in SIDES.items()}


@cuda.jit
def attention_combine_kernel(part_m, part_l, part_acc,  # as attention_kernel wrote them
                             out):  # (Q, H, D) float32, written
    # One thread block per (query, head): thread (t, g) owns dimension t and every
    # groups-th split from g (groups = blockDim.y). Rescale each split's sums to the largest max, add
    # them up, divide. A split that saw no cell has m = -inf and l = acc = 0, so its
    # weight exp(-inf) = 0 adds exact zeros: no branch in the loops. The groups' partial
    # sums are added in group order, so the result does not depend on timing.
    qi, h = cuda.blockIdx.x, cuda.blockIdx.y
    t, g = cuda.threadIdx.x, cuda.threadIdx.y
    n_splits, groups = part_m.shape[2], cuda.blockDim.y
    group_top = cuda.shared.array(MAX_COMBINE_GROUPS, float32)
    group_l = cuda.shared.array(MAX_COMBINE_GROUPS, float32)
    group_acc = cuda.shared.array((MAX_COMBINE_GROUPS, MAX_HEAD_DIM), float32)
    top = NEG_INF
    for s in range(g, n_splits, groups):
        top = max(top, part_m[qi, h, s])
    if t == 0:
        group_top[g] = top
    cuda.syncthreads()
    for j in range(groups):
        top = max(top, group_top[j])
    l, acc = float32(0.0), float32(0.0)
    if top > NEG_INF:
        for s in range(g, n_splits, groups):
            w = math.exp(part_m[qi, h, s] - top)
            l += part_l[qi, h, s] * w
            acc += part_acc[qi, h, s, t] * w
    group_acc[g, t] = acc
    if t == 0:
        group_l[g] = l
    cuda.syncthreads()
    if g == 0:
        l, acc = float32(0.0), float32(0.0)
        for j in range(groups):
            l += group_l[j]
            acc += group_acc[j, t]
        out[qi, h, t] = acc / l if l > 0 else float32(0.0)
# --8<-- [end:attention_kernel]


def side_arrays(kind, side, arrays, dev):
    """The two device arrays the kernel reads one side through (see the readers)."""
    if kind == "float":
        a = dev.read(arrays[side])
        return a, a  # the second is unused; passing it keeps one kernel signature
    if kind == "int8":
        return dev.read(arrays[f"{side}_q"]), dev.read(arrays[f"{side}_s"])
    a = dev.read(arrays[f"{side}_q4"])
    return a, view_bytes(a, np.float16)  # d of block g at [9 * g]


def tile_for(blocks, group: int, head_dim: int) -> int:
    """Queries per thread block: as many as the shared rows hold, when every tile's queries
    agree on each column of `blocks` (a block or -1: a prompt chunk's all_blocks_upto);
    otherwise, or when `blocks` is in device memory, 1."""
    most = min(MAX_TILE_ROWS // group, TILE_VALUES // (group * head_dim))
    n_q = blocks.shape[0]
    if not isinstance(blocks, np.ndarray) or n_q < 2 or most < 2:
        return 1
    tile = min(most, n_q)
    padded = np.full((-(-n_q // tile) * tile, blocks.shape[1]), -1, np.int32)
    padded[:n_q] = blocks
    padded = padded.reshape(-1, tile, blocks.shape[1])
    hi = padded.max(axis=1)
    lo = np.where(padded < 0, np.iinfo(np.int32).max, padded).min(axis=1)
    return tile if bool(np.all((hi < 0) | (lo == hi))) else 1


def attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out: bool = False,
              per_split: int | None = None, combine_groups: int = COMBINE_GROUPS, tile: int | None = None):
    """Like attention_ref, on the device; NumPy arguments are moved (out written back).

    One query per thread block (a decode step, a verify window, queries whose selections
    differ) runs attention_step_kernel; a prompt chunk's tiles run attention_kernel and
    the combine. per_split: selected blocks per thread block (each kernel has its own
    default), combine_groups: thread rows merging the tiled kernel's splits, tile: queries
    per thread block (default tile_for's choice); tests set them to get many splits,
    several rows and tiles under the simulator."""
    check_format(fmt, FORMATS)
    expect("q", q, np.float32, (None, None, None))
    n_q, n_heads, head_dim = q.shape
    expect("q_pos", q_pos, np.int32, (n_q,))
    expect("blocks", blocks, np.int32, (n_q, None))
    expect("page_table", page_table, np.int32, (None,))
    expect("out", out, np.float32, (n_q, n_heads, head_dim))
    specs = pool_arrays(fmt, head_dim)
    n_kv = pool[specs[0].field].shape[1]
    assert n_heads % n_kv == 0, f"{n_heads} query heads do not share {n_kv} KV heads evenly"
    group = n_heads // n_kv
    assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}, the shared tiles' width"
    assert group <= MAX_TILE_ROWS and group * head_dim <= TILE_VALUES, \
        f"{group} query heads of {head_dim} per KV head do not fit the shared rows"
    assert not rotate_out or head_dim % HADAMARD_N == 0, f"head_dim {head_dim} is not a multiple of {HADAMARD_N}"
    tile = tile_for(blocks, group, head_dim) if tile is None else tile
    assert 1 <= tile * group <= MAX_TILE_ROWS and tile * group * head_dim <= TILE_VALUES, f"tile {tile} too large"
    for spec in specs:
        expect_pool(spec.field, pool[spec.field], spec, n_kv)
    host = {s.field: host_or_absent(f"host {s.field}", (host or {}).get(s.field, np.empty(0)), s, n_kv)
            for s in specs}
    if n_q == 0:
        return
    kind_k, kind_v = SIDES[fmt]
    with DeviceArgs() as dev:
        sides = (*side_arrays(kind_k, "k", pool, dev), *side_arrays(kind_v, "v", pool, dev),
                 *side_arrays(kind_k, "k", host, dev), *side_arrays(kind_v, "v", host, dev))
        args = (dev.read(q), dev.read(q_pos), dev.read(blocks), dev.read(page_table), score_scale(head_dim))
        if tile == 1:
            attention_step(fmt, n_kv, args, sides, dev.write(out), rotate_out, per_split)
            return
        if per_split is None:  # long prompt chunks have tiles enough to fill the GPU: fewer, longer splits
            want = max(1, PROMPT_THREAD_BLOCKS // (-(-n_q // tile) * n_kv))
            per_split = max(BLOCKS_PER_SPLIT, -(-blocks.shape[1] // want))
        combine_groups = min(combine_groups, 1024 // head_dim)  # at most 1024 threads a block
        assert 1 <= combine_groups <= MAX_COMBINE_GROUPS, f"combine_groups {combine_groups} not in 1..{MAX_COMBINE_GROUPS}"
        n_splits = max(1, -(-blocks.shape[1] // per_split))
        part_m = device_empty((n_q, n_heads, n_splits), np.float32)
        part_l = device_empty((n_q, n_heads, n_splits), np.float32)
        part_acc = device_empty((n_q, n_heads, n_splits, head_dim), np.float32)
        ATTENTION_KERNELS[fmt][(-(-n_q // tile), n_kv, n_splits), THREADS, stream()](
            *args, np.int32(per_split), np.int32(tile), *sides, part_m, part_l, part_acc)
        mixed = device_empty(out.shape, np.float32) if rotate_out else dev.write(out)
        attention_combine_kernel[(n_q, n_heads), (head_dim, combine_groups), stream()](
            part_m, part_l, part_acc, mixed)
        if rotate_out:
            hadamard(mixed, out=dev.write(out))
