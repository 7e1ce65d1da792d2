"""The one writer: the only code that writes K/V cells into pools and host copies.

Every writer of KV (decode step, verify window, prompt chunk) comes here. The append
kernels write the host copy always (when there is one) and the VRAM slot only where the
block is resident (`page_table[block] >= 0`), so VRAM never goes stale and rejected
speculative cells need no invalidation: they are simply written over.

The forward pass hands each layer's `Append` (where its new cells go, room already made)
to the q|k|v product that makes k and v. The product writes them through `Append.write`,
or, for a decode step's fp16/fp32 cells on the cuda backend, in its own epilogue
(fast/matvec_fused.py, "Appending in the epilogue") through kv_append_fp16's device body:
the same rule, one launch fewer a layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.kv.hadamard import hadamard, hadamard_ref
from ..kernels.kv.key_sketch import key_sketch, key_sketch_ref
from ..kernels.kv.kv_append_fp16 import kv_append_fp16, kv_append_fp16_ref
from ..kernels.kv.kv_append_k8v4 import kv_append_k8v4, kv_append_k8v4_ref
from ..kernels.kv.kv_append_q4 import kv_append_q4, kv_append_q4_ref
from ..kernels.kv.kv_append_q8 import kv_append_q8, kv_append_q8_ref


@dataclass
class KVDest:
    """Where an append lands: a pool indexed by slot, its page table, and the host copy."""

    pool: dict  # field -> (n_slots, n_kv, BLOCK, per_head)
    page_table: object  # (n_blocks,) int32 block -> slot, -1 = not in this pool
    host: dict | None  # field -> (n_blocks, n_kv, BLOCK, per_head), None = no host copy


def host_field(dest: KVDest, field: str):
    """dest's host copy of `field`, or a size-0 array of the pool's dtype and rank: what
    the kernels read as "no host copy"."""
    if dest.host is not None:
        return dest.host[field]
    a = dest.pool[field]
    return np.empty((0,) + tuple(a.shape[1:]), a.dtype)


# --8<-- [start:append]
@dataclass(frozen=True)
class Append:
    """A layer's new cells' destination, room made (KVCache.append_to): where the q|k|v
    product's k and v go."""

    fmt: str
    dest: KVDest  # the layer
    positions: object  # (n,) int32 on the backend
    stage: KVDest | None = None  # a streamed prompt chunk's stage, written first
    fault: str = "none"
    sketch: object = None  # QSA's key sketch (kernels/kv/key_sketch.py), written with the cells
    verify: bool = False  # a verify window's cells

    @property
    def in_epilogue(self) -> bool:
        """Can a matvec's epilogue write these cells one value at a time? fp16/fp32 values
        are only cast; the quantized formats need a block's scale, QSA its key sketch. A verify
        window's cells (even a window of one token) go through `write`, as every window's."""
        return self.fmt in ("fp16", "fp32") and self.stage is None and self.sketch is None and not self.verify

    def epilogue_args(self) -> tuple:
        """kv_append_fp16's arguments after k_new, v_new: what the epilogue writes through."""
        d = self.dest
        return self.positions, d.page_table, d.pool["k"], d.pool["v"], host_field(d, "k"), host_field(d, "v")

    def write(self, be, k, v):
        """k, v (n, n_kv, hd) float32 after RoPE -> the stage (if any), then the layer."""
        if self.stage is not None:
            append_cells(be, self.fmt, self.stage, self.positions, k, v)
        dest = self.dest
        if self.verify and self.fault == "verify-no-mirror":
            dest = KVDest(dest.pool, dest.page_table, None)  # the batched append forgets the host copy
        append_cells(be, self.fmt, dest, self.positions, k, v, self.fault, self.sketch)
# --8<-- [end:append]


# --8<-- [start:append_cells]
def append_cells(be, fmt: str, dest: KVDest, positions, k, v, fault: str = "none", sketch=None):
    """k, v (n, n_kv, hd) float32 after RoPE -> dest's pool and host copy, rotated here
    where the format rotates (kv_layout.rotates). sketch: QSA's key sketch, whose cells are
    written with them (K as stored, kernels/kv/key_sketch.py), or None."""
    pool, pt = dest.pool, dest.page_table
    h = lambda f: host_field(dest, f)  # noqa: E731
    if fmt in ("fp16", "fp32"):
        be.op(kv_append_fp16_ref, kv_append_fp16)(k, v, positions, pt, pool["k"], pool["v"], h("k"), h("v"))
    elif fmt == "int8":
        be.op(kv_append_q8_ref, kv_append_q8)(k, v, positions, pt, pool["k_q"], pool["k_s"], pool["v_q"], pool["v_s"],
                              h("k_q"), h("k_s"), h("v_q"), h("v_s"))
    elif fmt == "q4_0":
        # K and V rotated first, by the hadamard kernel: QSA sketches the rotated K, the K
        # that attention scores against the rotated query
        rotate = be.op(hadamard_ref, hadamard)
        k, v = rotate(k), rotate(v)
        be.op(kv_append_q4_ref, kv_append_q4)(k, v, positions, pt, pool["k_q4"], pool["v_q4"], h("k_q4"), h("v_q4"))
    elif fmt == "k8v4":
        # two folded halves through the int8 and q4_0 kernels, and the key sketch, in one launch
        # (kernels/kv/kv_append_k8v4.py); the V half rotates V as it quantizes it.
        # --fault drop-v-mirror passes the V half unfolded: its host write is silently skipped
        be.op(kv_append_k8v4_ref, kv_append_k8v4)(k, v, positions, pt, pool, dest.host, fold_v_half=(fault != "drop-v-mirror"),
                                sketch=sketch)
        sketch = None  # written already
    else:
        raise ValueError(f"no writer for KV format {fmt!r}")
    if sketch is not None:
        be.op(key_sketch_ref, key_sketch)(k, positions, sketch)
# --8<-- [end:append_cells]
