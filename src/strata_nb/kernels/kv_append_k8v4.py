"""KV append for k8v4: K as int8, rotated V as q4_0, through the two single-format writers.

k8v4 has no kernel of its own. Its K half goes through kv_append_q8 and its V half
through kv_append_q4. Each of those writes a K side and a V side and tests the K-side
host array for presence; a k8v4 half has only one side, so each half is passed FOLDED:
both sides name the same arrays and the same input. The second side's lanes rewrite
identical bytes (a little wasted work), and the K-side presence test sees the half's
real host array.

`fold_v_half=False` passes the V half the tempting way instead: the pool still folded,
but the host copy given only as the V-side array. The K-side test then finds no host
copy and skips every host write of V, silently. A V cell whose block is not resident
is then written nowhere; one whose block is resident lives only in its VRAM slot until
the slot is evicted. Either way attention later reads zeros for V from the host copy,
and generation degrades while nothing crashes (DESIGN.md, "The host copy and the one
writer"). It exists as the teaching fault that tests/kernels/test_kv_hybrid_parity.py
must catch; the engine never sets it.

Backend choice: `kv_append_k8v4_ref` (NumPy, the engine's numpy backend) and
`kv_append_k8v4` (the kernels) take the same arguments, like every module here.
"""
from __future__ import annotations

import numpy as np

from strata_nb.kernels.kv_append_q4 import kv_append_q4, kv_append_q4_ref
from strata_nb.kernels.kv_append_q8 import kv_append_q8, kv_append_q8_ref


# --8<-- [start:append_halves]
def append_halves(append_q8, append_q4,  # the q8 and q4 writers: both refs or both kernels
                  k,           # (n, n_kv, head_dim) float32, roped
                  v_rot,       # (n, n_kv, head_dim) float32, Hadamard-rotated
                  positions,   # (n,) int32 absolute cell positions
                  page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                  pool,        # {"k_q", "k_s", "v_q4"}: the VRAM pool, by slot
                  host,        # the same fields by logical block, or None = absent
                  fold_v_half: bool):
    host = host or {f: np.empty((0,), pool[f].dtype) for f in ("k_q", "k_s", "v_q4")}
    # K half, folded: the V lanes quantize k again into the same K arrays.
    append_q8(k, k, positions, page_table,
              pool["k_q"], pool["k_s"], pool["k_q"], pool["k_s"],
              host["k_q"], host["k_s"], host["k_q"], host["k_s"])
    if fold_v_half:
        # V half, folded: the "K" lanes write V too, and the K-side host array is real.
        append_q4(v_rot, v_rot, positions, page_table,
                  pool["v_q4"], pool["v_q4"], host["v_q4"], host["v_q4"])
    else:
        # The teaching fault: only the V-side host array; the K side looks absent.
        append_q4(v_rot, v_rot, positions, page_table,
                  pool["v_q4"], pool["v_q4"], np.empty((0,), np.uint8), host["v_q4"])
# --8<-- [end:append_halves]


def kv_append_k8v4_ref(k, v_rot, positions, page_table, pool, host, *, fold_v_half=True):
    """The k8v4 append with the NumPy writers; pool and host are written in place."""
    append_halves(kv_append_q8_ref, kv_append_q4_ref, k, v_rot, positions, page_table,
                  pool, host, fold_v_half)


def kv_append_k8v4(k, v_rot, positions, page_table, pool, host, *, fold_v_half=True):
    """The k8v4 append with the kernels; pool and host are written in place."""
    append_halves(kv_append_q8, kv_append_q4, k, v_rot, positions, page_table,
                  pool, host, fold_v_half)
