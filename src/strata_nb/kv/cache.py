"""The KV cache: every layer's pool, page table and (when streaming) host copy.

Fully resident (`--kv-resident 0`): each layer's pool has a slot for every block of the
context and the page table is the identity, so block b lives in slot b. The engine above
only calls `append` (the one writer) and `attend`.
"""
from __future__ import annotations

import numpy as np

from .formats import BLOCK, pool_arrays, rotates
from .writer import append_cells


class LayerKV:
    """One layer's K/V as the kernels see it."""

    def __init__(self, be, fmt: str, n_kv: int, head_dim: int, n_slots: int, n_blocks: int, host: bool):
        arrays = pool_arrays(fmt, head_dim)
        # pool[field]: (n_slots, n_kv, BLOCK, per_head) -- "VRAM", indexed by slot
        self.pool = {a.field: be.zeros((n_slots, n_kv, BLOCK, a.per_head), a.dtype) for a in arrays}
        # host[field]: (n_blocks, n_kv, BLOCK, per_head) -- the authoritative copy, by block
        self.host = ({a.field: be.host_array((n_blocks, n_kv, BLOCK, a.per_head), a.dtype) for a in arrays}
                     if host else None)
        # page_table: (n_blocks,) int32 logical block -> slot, -1 = not in VRAM
        self.page_table = be.asarray(np.arange(n_blocks, dtype=np.int32))


class KVCache:
    def __init__(self, be, cfg, fmt: str, max_context: int, fault: str = "none"):
        self.be, self.cfg, self.fmt, self.fault = be, cfg, fmt, fault
        self.max_context = max_context
        self.n_blocks = -(-max_context // BLOCK)
        self.layers = [LayerKV(be, fmt, cfg.n_kv_heads, cfg.head_dim, self.n_blocks, self.n_blocks, host=False)
                       for _ in range(cfg.n_layers)]
        self._hadamard = be.op("hadamard")
        self._attention = be.op("attention")

    def append(self, layer: int, positions, k, v):
        """k, v (n, n_kv, hd) float32 after RoPE -> written into the cache at `positions`."""
        if "k" in rotates(self.fmt):
            k = self._hadamard(k)
        if "v" in rotates(self.fmt):
            v = self._hadamard(v)
        append_cells(self.be, self.fmt, self.layers[layer], positions, k, v, fault=self.fault)

    def attend(self, layer: int, q, positions):
        """q (n, n_heads, hd) float32 at `positions` -> attention output (n, n_heads, hd)."""
        if "q" in rotates(self.fmt):
            q = self._hadamard(q)  # <Hq, Hk> = <q, k>: the rotation cancels in the scores
        blocks = self.be.asarray(all_blocks_upto(self.be.to_numpy(positions)))
        L = self.layers[layer]
        out = self.be.zeros(q.shape, np.float32)
        self._attention(self.fmt, q, positions, blocks, L.page_table, L.pool, L.host, out)
        if "v" in rotates(self.fmt):
            out = self._hadamard(out)  # mixed rotated V rows: rotate back once (H is its own inverse)
        return out


def all_blocks_upto(positions: np.ndarray) -> np.ndarray:
    """(n,) positions -> (n, max_block + 1) int32: each query's blocks 0..pos//BLOCK, -1 padded."""
    last = np.asarray(positions) // BLOCK
    cols = np.arange(int(last.max()) + 1, dtype=np.int32)
    return np.where(cols[None, :] <= last[:, None], cols[None, :], -1).astype(np.int32)
