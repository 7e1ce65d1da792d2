"""Gather rows of a table by index: token embeddings (the table in its GGUF quantized form,
dequantized on the way) and the RoPE cos/sin rows of each position (a float32 table).

The default model's token_embd is Q8_0, 49152 x 576, and is also its output head, so it
stays quantized on the device (30 MiB rather than 108 MiB) and a lookup dequantizes only
the rows it gathers, with gguf_rows.py's dequantizers: one thread per (row, part of a
32-value block), 8 values each. A float32 table is a plain copy, one thread per value.

Dequantization is exact in float32 and a copy is a copy, so the kernels equal the
reference bit for bit.

`ids` must lie in [0, rows): the launcher checks NumPy ids; ids already on the device
are the caller's to get right (token ids from the tokenizer, positions under the
context length).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for, is_host_numpy
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QK, QTYPES, part_runs, row_values, weight_views
from strata_nb.model.dequant import dequantize


# --8<-- [start:embed_ref]
def embed_ref(table,  # (rows, d) float32 when qtype is None, else (rows, bytes_per_row) uint8 GGUF rows
              ids,    # (n,) int32 which rows
              out,    # (n, d) float32, written
              qtype=None):  # None, or "Q4_0", "Q4_1", "Q8_0", "F16", "F32"
    rows = table[ids]
    out[...] = rows if qtype is None else dequantize(rows, qtype)
# --8<-- [end:embed_ref]


# --8<-- [start:embed_kernel]
@cuda.jit(cache=True)
def embed_rows_kernel(table,  # (rows, d) float32
                      ids,    # (n,) int32
                      out):   # (n, d) float32, written
    lane = cuda.grid(1)  # one value of one gathered row
    d = out.shape[1]
    if lane < ids.shape[0] * d:
        i, j = lane // d, lane % d
        out[i, j] = table[ids[i], j]


def make_row_part(part, nibbles):
    """For one weight type (its dequantizer `part`): part q of a GGUF row, dequantized into
    its 8 places of a float32 row. The embed kernel below gathers rows with it, and so
    does the megakernel's first stage (fast/mega/stages.py)."""

    @cuda.jit(device=True)
    def row_part(a, b,  # (rows, *) views a and b of the table's GGUF rows (gguf_rows.QTYPES)
                 row,   # the row of the table
                 q,     # the part: values 8q.. of the row, block q // 4
                 out, i):  # (n, d) float32: its row i written
        blk, p = q // PARTS, q % PARTS
        w = cuda.local.array(PART, float32)
        part(a, b, row, blk, p, w)
        lo, hi = part_runs(nibbles, p)
        for j in range(4):
            out[i, blk * QK + lo + j] = w[j]
            out[i, blk * QK + hi + j] = w[4 + j]

    return row_part


def make_embed_kernel(row_part):
    @cuda.jit(cache=True)
    def embed_kernel(a,    # (rows, *) view a of the table's GGUF rows (gguf_rows.QTYPES)
                     b,    # (rows, *) view b of the same bytes
                     ids,  # (n,) int32
                     out):  # (n, d) float32, written
        lane = cuda.grid(1)  # one part (8 values) of one gathered row
        n_parts = out.shape[1] // PART
        if lane < ids.shape[0] * n_parts:
            i, q = lane // n_parts, lane % n_parts
            row_part(a, b, ids[i], q, out, i)

    return embed_kernel


ROW_PARTS = {qtype: make_row_part(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}
EMBED_KERNELS = {qtype: make_embed_kernel(row_part) for qtype, row_part in ROW_PARTS.items()}
# --8<-- [end:embed_kernel]


def embed(table, ids, out, qtype=None):
    """Like embed_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("ids", ids, np.int32, (None,))
    n = ids.shape[0]
    if qtype is None:
        expect("table", table, np.float32, (None, None))
        d = table.shape[1]
    else:
        expect("table", table, np.uint8, (None, None))
        d = row_values(qtype, table.shape[1])
    expect("out", out, np.float32, (n, d))
    if is_host_numpy(ids):
        assert ((ids >= 0) & (ids < table.shape[0])).all(), f"ids outside [0, {table.shape[0]})"
    if n * d == 0:
        return
    with DeviceArgs() as dev:
        if qtype is None:
            embed_rows_kernel[grid_for(n * d)](dev.read(table), dev.read(ids), dev.write(out))
        else:
            EMBED_KERNELS[qtype][grid_for(n * d // PART)](*weight_views(dev.read(table), qtype),
                                                          dev.read(ids), dev.write(out))
