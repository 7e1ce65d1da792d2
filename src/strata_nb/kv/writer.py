"""The one writer: the only code that writes K/V cells into pools and host copies.

Every writer of KV (decode step, verify window, prompt chunk) comes here. The append
kernels write the host copy always (when there is one) and the VRAM slot only where the
block is resident (`page_table[block] >= 0`), so VRAM never goes stale and rejected
speculative cells need no invalidation: they are simply written over.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KVDest:
    """Where an append lands: a pool indexed by slot, its page table, and the host copy."""

    pool: dict  # field -> (n_slots, n_kv, BLOCK, per_head)
    page_table: object  # (n_blocks,) int32 block -> slot, -1 = not in this pool
    host: dict | None  # field -> (n_blocks, n_kv, BLOCK, per_head), None = no host copy


def _absent(a) -> np.ndarray:
    """A size-0 array of a's dtype and rank: what the kernels read as "no host copy"."""
    return np.empty((0,) + tuple(a.shape[1:]), a.dtype)


# --8<-- [start:append_cells]
def append_cells(be, fmt: str, dest: KVDest, positions, k, v, fault: str = "none", bounds=None):
    """k, v (n, n_kv, hd) float32 after RoPE -> dest's pool and host copy, rotated here
    where the format rotates (formats.rotates). bounds: QSA's (kmin, kmax) of K, kept at
    append time (kernels/block_bounds.py), or None."""
    pool, pt = dest.pool, dest.page_table
    h = (lambda f: dest.host[f]) if dest.host is not None else (lambda f: _absent(pool[f]))
    if fmt in ("fp16", "fp32"):
        be.op("kv_append_fp16")(k, v, positions, pt, pool["k"], pool["v"], h("k"), h("v"))
    elif fmt == "int8":
        be.op("kv_append_q8")(k, v, positions, pt, pool["k_q"], pool["k_s"], pool["v_q"], pool["v_s"],
                              h("k_q"), h("k_s"), h("v_q"), h("v_s"))
    elif fmt == "q4_0":
        # K and V rotated first, by the hadamard kernel: QSA keeps the bounds of the rotated
        # K, the K that attention scores against the rotated query
        rotate = be.op("hadamard")
        k, v = rotate(k), rotate(v)
        be.op("kv_append_q4")(k, v, positions, pt, pool["k_q4"], pool["v_q4"], h("k_q4"), h("v_q4"))
    elif fmt == "k8v4":
        # two folded halves through the int8 and q4_0 kernels, and the bounds, in one launch
        # (kernels/kv_append_k8v4.py); the V half rotates V as it quantizes it.
        # --fault drop-v-mirror passes the V half unfolded: its host write is silently skipped
        be.op("kv_append_k8v4")(k, v, positions, pt, pool, dest.host, fold_v_half=(fault != "drop-v-mirror"),
                                bounds=bounds)
        bounds = None  # kept already
    else:
        raise ValueError(f"no writer for KV format {fmt!r}")
    if bounds is not None:
        be.op("block_bounds")(k, positions, *bounds)
# --8<-- [end:append_cells]
