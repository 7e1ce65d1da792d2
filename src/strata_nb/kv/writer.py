"""The one writer: the only code that writes K/V bytes into pools and host copies.

Every writer of KV (decode step, verify window, prompt chunk, snapshot restore) comes
here. The append kernels write the host copy always (when there is one) and the VRAM slot
only where the block is resident (`page_table[block] >= 0`), so VRAM never goes stale.
"""
from __future__ import annotations


def _host_or_absent(be, L, field):
    """The host copy's array, or a size-0 array of the same type: the kernels' "absent"."""
    if L.host is not None:
        return L.host[field]
    a = L.pool[field]
    return be.zeros((0,) + tuple(a.shape[1:]), a.dtype)


# --8<-- [start:append_cells]
def append_cells(be, fmt: str, L, positions, k, v, fault: str = "none"):
    """k, v (n, n_kv, hd) float32 (rotated where the format rotates) -> pool + host copy."""
    pool, pt = L.pool, L.page_table
    h = lambda field: _host_or_absent(be, L, field)
    if fmt in ("fp16", "fp32"):
        be.op("kv_append_fp16")(k, v, positions, pt, pool["k"], pool["v"], h("k"), h("v"))
    elif fmt == "int8":
        be.op("kv_append_q8")(k, v, positions, pt, pool["k_q"], pool["k_s"], pool["v_q"], pool["v_s"],
                              h("k_q"), h("k_s"), h("v_q"), h("v_s"))
    elif fmt == "q4_0":
        be.op("kv_append_q4")(k, v, positions, pt, pool["k_q4"], pool["v_q4"], h("k_q4"), h("v_q4"))
    elif fmt == "k8v4":
        # Two halves that reuse the single-format kernels, each passed FOLDED: both fields of
        # a half point at the one array, because the kernels test only the K-side host
        # array for presence. The K half: int8 codes and scales of K.
        be.op("kv_append_q8")(k, k, positions, pt, pool["k_q"], pool["k_s"], pool["k_q"], pool["k_s"],
                              h("k_q"), h("k_s"), h("k_q"), h("k_s"))
        # The V half: rotated q4_0 of V. `--fault drop-v-mirror` passes it unfolded (only the
        # V-side host array set), exactly the bug: the host write is silently skipped.
        host_k_side = _host_or_absent(be, _NoHost(L), "v_q4") if fault == "drop-v-mirror" else h("v_q4")
        be.op("kv_append_q4")(v, v, positions, pt, pool["v_q4"], pool["v_q4"], host_k_side, h("v_q4"))
    else:
        raise ValueError(f"no writer for KV format {fmt!r}")
# --8<-- [end:append_cells]


class _NoHost:
    """A view of a layer with its host copy hidden (used only by the teaching fault)."""

    def __init__(self, L):
        self.pool, self.host = L.pool, None
