"""The KV layout: cells, blocks, formats, and the maps that say where a block sits.

Every other module of the engine imports this one and it imports none of them: the
kernels, the cache and the CLI all take their shapes from here.

A *cell* is one token of one layer (K and V for every KV head); a *block* is BLOCK = 16
consecutive cells of one layer. Every pool is laid out [block][kv_head][cell_in_block][...],
so one block is one contiguous byte run in each of the format's arrays. This module is the
single source of those sizes: the writer, the movers (copy runs, staging, ring restore,
snapshots) and `strata-nb info` all ask it, and none of them special-cases a format.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 16  # cells per block: the unit of allocation, selection, streaming and copying
INT8_GROUP = 64  # values per int8 scale
Q4_GROUP = 32  # values per ggml block_q4_0
Q4_BYTES = 18  # block_q4_0: fp16 d + 16 bytes of nibbles

FORMATS = ("fp32", "fp16", "int8", "q4_0", "k8v4")
USER_FORMATS = ("fp16", "int8", "q4_0", "k8v4")  # what --kv offers; fp32 is the reference cache


@dataclass(frozen=True)
class PoolArray:
    """One array of a pool: a field name, its dtype and its per-(cell, head) trailing shape."""

    field: str  # e.g. "k_q"
    run: str  # the run's name as users see it, e.g. "k codes"
    dtype: np.dtype
    per_head: int  # elements per (cell, head)

    def block_bytes(self, n_kv_heads: int) -> int:
        return BLOCK * n_kv_heads * self.per_head * self.dtype.itemsize


# --8<-- [start:pool_arrays]
def pool_arrays(fmt: str, head_dim: int) -> tuple[PoolArray, ...]:
    """The arrays of a format's pool, in run order (docs/design.md, "KV cells, blocks,
    formats")."""
    check_format(fmt, FORMATS)
    if head_dim % INT8_GROUP:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {INT8_GROUP}")
    f16, i8, u8 = np.dtype(np.float16), np.dtype(np.int8), np.dtype(np.uint8)
    codes = lambda side: PoolArray(f"{side}_q", f"{side} codes", i8, head_dim)
    scales = lambda side: PoolArray(f"{side}_s", f"{side} scales", f16, head_dim // INT8_GROUP)
    q4 = lambda side: PoolArray(f"{side}_q4", f"{side} q4", u8, head_dim // Q4_GROUP * Q4_BYTES)
    return {
        "fp32": (PoolArray("k", "k", np.dtype(np.float32), head_dim),
                 PoolArray("v", "v", np.dtype(np.float32), head_dim)),
        "fp16": (PoolArray("k", "k", f16, head_dim), PoolArray("v", "v", f16, head_dim)),
        "int8": (codes("k"), codes("v"), scales("k"), scales("v")),
        "q4_0": (q4("k"), q4("v")),
        "k8v4": (codes("k"), scales("k"), q4("v")),
    }[fmt]
# --8<-- [end:pool_arrays]


def runs_of(fmt: str, n_kv_heads: int, head_dim: int) -> list[tuple[str, str, int]]:
    """The byte runs one block moves as: (run name, pool field, bytes per block)."""
    return [(a.run, a.field, a.block_bytes(n_kv_heads)) for a in pool_arrays(fmt, head_dim)]


def kv_block_bytes(fmt: str, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer, all runs together."""
    return sum(n for _, _, n in runs_of(fmt, n_kv_heads, head_dim))


def cell_bytes(fmt: str, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of one cell (one token of one layer, K and V of every KV head)."""
    return kv_block_bytes(fmt, n_kv_heads, head_dim) // BLOCK


def token_bytes(fmt: str, cfg) -> int:
    """Bytes one token occupies in the cache: a cell in every layer of model `cfg`."""
    return cell_bytes(fmt, cfg.n_kv_heads, cfg.head_dim) * cfg.n_layers


def check_format(fmt: str, allowed=USER_FORMATS) -> str:
    if fmt not in allowed:
        raise ValueError(f"unknown KV format {fmt!r}; choose one of {', '.join(allowed)}")
    return fmt


def rotates(fmt: str) -> str:
    """Which of q, k, v go through the Hadamard rotation for this format.

    q4_0 rotates K and V (and Q, so that <Hq, Hk> = <q, k>); k8v4 rotates only V. Where V is
    rotated, attention mixes rotated rows and the output is rotated back once.
    """
    return {"q4_0": "qkv", "k8v4": "v"}.get(fmt, "")


# ---- which blocks hold cells, and where a block sits -------------------------------
def all_blocks_upto(positions: np.ndarray) -> np.ndarray:
    """(n,) positions -> (n, max_block + 1) int32: each query's blocks 0..pos//BLOCK, -1 padded."""
    last = np.asarray(positions) // BLOCK
    cols = np.arange(int(last.max()) + 1, dtype=np.int32)
    return np.where(cols[None, :] <= last[:, None], cols[None, :], -1).astype(np.int32)


def shared_blocks_upto(positions: np.ndarray, row=None):
    """(n,) positions -> (1, max_block + 1) int32: blocks 0..max(pos)//BLOCK as one selection
    that every query shares. Attention masks each query's cells after its position, so
    this reads what all_blocks_upto does, without an (n, max_block + 1) array: a prompt
    chunk of 2,048 queries at 8K context would build and send 4 MB of it per layer.
    row: (1, n_blocks) holding 0, 1, ... (a device array made once) to return a view of."""
    width = int(np.asarray(positions).max()) // BLOCK + 1
    return np.arange(width, dtype=np.int32).reshape(1, -1) if row is None else row[:, :width]


# --8<-- [start:sliding_window]
def blocks_in_window(positions: np.ndarray, window: int) -> np.ndarray:
    """(n,) positions -> (n, width) int32: each query's blocks from its window's first
    position (pos - window + 1) to its own, ascending, -1 padded: what a sliding-window
    layer reads (attention masks the cells before the window in its first block)."""
    positions = np.asarray(positions)
    first = np.maximum(positions - window + 1, 0) // BLOCK
    last = positions // BLOCK
    cols = first[:, None] + np.arange(int((last - first).max()) + 1, dtype=np.int32)[None, :]
    return np.where(cols <= last[:, None], cols, -1).astype(np.int32)


def ring_blocks(window: int, rows: int) -> int:
    """Slots of a sliding-window layer's ring: enough that a pass of `rows` new cells,
    written before any of its queries attends, overwrites no cell its first query's window
    still holds. Cells go to slot block % ring, so the ring holds the last ring blocks."""
    return -(-(window + rows - 1) // BLOCK) + 1
# --8<-- [end:sliding_window]


# --8<-- [start:point]
def point(page_table, slot_block, block: int, slot: int):
    """Put `block` in `slot`: the slot's old block and the block's old slot are unmapped,
    so the two maps stay inverse."""
    old = slot_block[slot]
    if old >= 0:
        page_table[old] = -1
    prev = page_table[block]
    if prev >= 0:
        slot_block[prev] = -1
    page_table[block], slot_block[slot] = slot, block
# --8<-- [end:point]
