"""GQA attention over selected KV blocks, for every KV format, dequantizing as it reads:
the reference (the spec, and the CPU engine's attention) and `attention`, the launcher
that checks the arrays and picks a kernel.

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

The kernels, by where they run:

- attention_step.py, decode (a step, a verify window: one query per thread block):
  `attention_step_kernel1`, the plain kernel (a thread block per (query, head), an
  online softmax over the cells one at a time), and `attention_step_kernel`, the one
  the engine runs (a split of the selection per thread block, merged by the last);
- attention_prefill.py, a prompt chunk: a tile of queries per thread block, then a
  combine kernel that merges the splits.

The reference is called for prefill chunks of up to 256 queries over thousands of
cells, so it is vectorized: gather and dequantize the union of the selected blocks once,
one masked float32 softmax, matmuls. Its result depends only on the bytes it reads, so
reading from the pool or from the host copy gives the same bits. Cells that no query in
the call can see (the unwritten tail of the newest block) count as zero, as they do in
the kernels, which never read them.

Kernel vs reference tolerance: |kernel - ref| <= ATOL + RTOL * |ref|, for V values of
order 1. Both compute in float32 on identical dequantized values (dequantization is exact
in both); they differ only in the order of float32 sums (a 64-term dot product per score;
the kernels' online softmax, cell by cell, round by round or split by split, and the
merge of the splits, against one max and one sum; a sum over up to S * 16 cells per
output) and in exp (CUDA's expf is within 2 ulp). Each of those is a few ulp (float32
eps = 1.2e-7) of the values summed, so errors are around 1e-6; the tolerance leaves over
10x headroom.

Selections list distinct blocks; a query that sees no cell gets zeros.
"""
from __future__ import annotations

import numpy as np

from strata_nb.gpu.geometry import COMBINE_GROUPS
from strata_nb.gpu.launch import DeviceArgs, expect, expect_pool, host_or_absent, view_bytes
from strata_nb.gpu import tensor_core
from strata_nb.kernels.attention import attention_prefill_mma as mma_prompt
from strata_nb.kernels.attention.attention_prefill import attention_prompt, most_queries, tile_for
from strata_nb.kernels.attention.attention_step import MAX_HEAD_DIM, attention_step, attention_step1
from strata_nb.kernels.kv.hadamard import N as HADAMARD_N
from strata_nb.kernels.kv.hadamard import hadamard_ref
from strata_nb.kernels.kv.kv_readers import SIDES
from strata_nb.kernels.kv.quant_int8 import dequantize_int8_ref
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_ref
from strata_nb.kv_layout import BLOCK, FORMATS, check_format, pool_arrays

ATOL = 2e-5
RTOL = 1e-4

NEG_INF = np.float32(-np.inf)


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
                  blocks,      # (Q, S) int32 selected logical blocks, -1 = padding; (1, S): every query's
                  page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                  pool,        # {field: (n_slots, n_kv, 16, per_head)} as formats.pool_arrays
                  host,        # {field: (n_logical_blocks, n_kv, 16, per_head)}, or None
                  out,         # (Q, H, D) float32, written
                  rotate_out: bool = False,  # apply H to each output head row (a rotated V comes back)
                  ordered: bool | None = None,  # the launcher's hint (rows ascend); a set here
                  rows_alone: bool = False):  # the launcher's: a row never depends on the others here
    check_format(fmt, FORMATS)
    # Unwritten cells may hold any bytes (NaN, inf, huge): they are masked out below, so
    # the warnings their arithmetic raises on the way are noise.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        o = attend_ref(fmt, q, q_pos, blocks, page_table, pool, host)
    out[...] = hadamard_ref(o) if rotate_out else o


def attend_ref(fmt, q, q_pos, blocks, page_table, pool, host):
    """attention_ref's arithmetic; returns the (Q, H, D) float32 output.

    Queries that share one selection (a prompt chunk's (1, S)) are the rows of one product.
    Queries with a selection each (a decode step, a verify window) are worked out one at a
    time, so a window's query gets the bits of the decode step at its position
    (product_ref, kernels/dense/matvec.py, says why that matters)."""
    if blocks.shape[0] > 1:
        return np.concatenate([attend_together(fmt, q[i:i + 1], q_pos[i:i + 1], blocks[i:i + 1], page_table, pool,
                                               host) for i in range(len(q))])
    return attend_together(fmt, q, q_pos, blocks, page_table, pool, host)


def attend_together(fmt, q, q_pos, blocks, page_table, pool, host):
    """Queries that share a selection (or one query), as the rows of one masked softmax."""
    n_q, n_heads, head_dim = q.shape
    blocks = np.broadcast_to(blocks, (n_q, blocks.shape[1]))  # a (1, S) selection is every query's
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


def side_arrays(kind, side, arrays, dev):
    """The two device arrays the kernel reads one side through (see the readers)."""
    if kind == "float":
        a = dev.read(arrays[side])
        return a, a  # the second is unused; passing it keeps one kernel signature
    if kind == "int8":
        return dev.read(arrays[f"{side}_q"]), dev.read(arrays[f"{side}_s"])
    a = dev.read(arrays[f"{side}_q4"])
    return a, view_bytes(a, np.float16)  # d of block g at [9 * g]


def ordered_rows(blocks: np.ndarray) -> bool:
    """Does every row of a selection ascend, with its -1 padding at the end? all_blocks_upto's
    and select_blocks' lists do; attention_ref reads any order, as a set."""
    before, after = blocks[:, :-1], blocks[:, 1:]
    return bool(np.all((after < 0) | ((before >= 0) & (after >= before))))


def attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out: bool = False,
              per_split: int | None = None, combine_groups: int = COMBINE_GROUPS, tile: int | None = None,
              ordered: bool | None = None, plain: bool = False, rows_alone: bool = False,
              mma: bool | None = None):
    """Like attention_ref, on the device; NumPy arguments are moved (out written back).

    One query per thread block (a decode step, a verify window, queries whose selections
    differ) runs attention_step_kernel (attention_step.py); a prompt chunk's tiles run
    attention_kernel and the combine (attention_prefill.py). plain: run
    attention_step_kernel1 instead, the plain decode kernel (the tests check it).

    per_split: selected blocks per thread block (each kernel has its own default),
    combine_groups: thread rows merging the prompt kernel's splits, tile: queries per
    thread block (default tile_for's choice); tests set them to get many splits, several
    rows and tiles under the simulator. ordered: every row of `blocks` ascends with
    its padding at the end, which lets the step kernel skip the merge for a query whose
    cells all lie in its first split. None: a NumPy list is looked at, a device one taken
    as unordered; True for a device list is the caller's word (a step's list); False
    turns the shortcut off. rows_alone: a prompt chunk's query gets the same bits
    whatever chunk it comes in, and however far the shared row of blocks reaches
    (attention_prompt says how). mma: a prompt chunk's tiles run the tensor-core kernel
    (attention_prefill_mma.py) instead; None = where tensor_core.enabled() and it can
    run, True = it must."""
    assert not plain or per_split is None, "the plain kernel has no splits"
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
    group = n_heads // n_kv
    assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}, the shared tiles' width"
    if mma is None:
        mma = tensor_core.enabled() and not mma_prompt.usable(head_dim)
    assert not mma or not mma_prompt.usable(head_dim), f"no tensor-core prompt kernel: {mma_prompt.usable(head_dim)}"
    most = mma_prompt.most_queries(group) if mma else most_queries(group, head_dim)
    assert most >= 1, f"{group} query heads of {head_dim} per KV head do not fit the shared rows"
    assert not rotate_out or head_dim % HADAMARD_N == 0, f"head_dim {head_dim} is not a multiple of {HADAMARD_N}"
    tile = 1 if plain else (tile_for(blocks, group, head_dim, n_q, most) if tile is None else tile)
    assert 1 <= tile <= most, f"tile {tile} too large: a thread block takes {most} queries"
    for spec in specs:
        expect_pool(spec.field, pool[spec.field], spec, n_kv)
    host = {s.field: host_or_absent(f"host {s.field}", (host or {}).get(s.field, np.empty(0)), s, n_kv)
            for s in specs}
    if n_q == 0:
        return
    assert not rows_alone or blocks.shape[0] == 1, "rows_alone is for a prompt chunk's shared row"
    kind_k, kind_v = SIDES[fmt]
    step_kernel = tile == 1 and not rows_alone  # one query per thread block (rows_alone: the prompt kernel's bits)
    if step_kernel and blocks.shape[0] != n_q:  # the step kernel reads a row per query
        assert isinstance(blocks, np.ndarray), "a shared selection in device memory is for one query"
        blocks = np.ascontiguousarray(np.broadcast_to(blocks, (n_q, blocks.shape[1])))
    with DeviceArgs() as dev:
        sides = (*side_arrays(kind_k, "k", pool, dev), *side_arrays(kind_v, "v", pool, dev),
                 *side_arrays(kind_k, "k", host, dev), *side_arrays(kind_v, "v", host, dev))
        args = (dev.read(q), dev.read(q_pos), dev.read(blocks), dev.read(page_table), score_scale(head_dim))
        if step_kernel:
            if isinstance(blocks, np.ndarray):  # looked at: None = as found, True = it must be
                found = ordered_rows(blocks)
                assert found or not ordered, "ordered=True, but a row of blocks does not ascend with its padding last"
                ordered = found if ordered is None else ordered
            if plain:
                attention_step1(fmt, args, sides, dev.write(out), rotate_out)
            else:
                attention_step(fmt, n_kv, args, sides, dev.write(out), rotate_out, per_split, bool(ordered))
            return
        # the tensor-core kernel by keyword only, so an older attention_prompt still runs
        # the plain one (tools/kernel_ab.py times a launcher from another revision)
        kernel = {"kernel": mma_prompt.MMA_KERNELS[fmt, head_dim], "threads": mma_prompt.MMA_THREADS} if mma else {}
        attention_prompt(fmt, n_kv, args, sides, dev.write(out), rotate_out, per_split, combine_groups, tile,
                         rows_alone, **kernel)
