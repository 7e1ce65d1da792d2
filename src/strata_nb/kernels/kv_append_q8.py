"""KV append for int8 pools (and the K half of k8v4): quantize each new cell, write it.

The same writer as kv_append_fp16.py (read its docstring first): VRAM slot if resident,
host copy if present, presence tested on the K-side host array (`host_k_q`) alone. Each
lane quantizes one 64-value group of one head of one cell, for K or for V, with
quant_int8's device function, once into each destination; the quantizer is
deterministic, so the pool and the host copy get the same bytes.

k8v4 calls this with its K half FOLDED: `k_q = v_q = pool.k_q`, `host_k_q = host_v_q =
host.k_q` (and the scales likewise), `k_new = v_new = k`. The V lanes then rewrite the
identical K bytes, and the K-side presence test sees the real host array.
`_ref` and the launcher take the same arguments and both write the given arrays in place.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.kernels.launch import DeviceArgs, expect_pool, expect_window, grid_for, host_or_absent
from strata_nb.kernels.quant_int8 import quantize_int8_group, quantize_int8_ref
from strata_nb.kv.formats import BLOCK, INT8_GROUP, pool_arrays


# --8<-- [start:kv_append_q8_ref]
def kv_append_q8_ref(k_new,       # (n, n_kv, head_dim) float32
                     v_new,       # (n, n_kv, head_dim) float32
                     positions,   # (n,) int32 absolute cell positions
                     page_table,  # (n_logical_blocks,) int32 slot, -1 = not resident
                     k_q, k_s, v_q, v_s,  # VRAM pool by slot: (n_slots, n_kv, 16, head_dim) int8,
                                          #                    (n_slots, n_kv, 16, head_dim // 64) float16
                     host_k_q, host_k_s, host_v_q, host_v_s):  # host copy by logical block, size 0 = absent
    block, cell = positions // BLOCK, positions % BLOCK
    slot = page_table[block]
    resident = slot >= 0
    host_present = host_k_q.shape[0] > 0  # the K-side array decides for both sides
    for new, q, s, host_q, host_s in ((k_new, k_q, k_s, host_k_q, host_k_s),
                                      (v_new, v_q, v_s, host_v_q, host_v_s)):
        codes, scales = quantize_int8_ref(new)  # (n, n_kv, head_dim), (n, n_kv, head_dim // 64)
        q[slot[resident], :, cell[resident]] = codes[resident]
        s[slot[resident], :, cell[resident]] = scales[resident]
        if host_present:
            host_q[block, :, cell] = codes
            host_s[block, :, cell] = scales
# --8<-- [end:kv_append_q8_ref]


# --8<-- [start:kv_append_q8_kernel]
@cuda.jit
def kv_append_q8_kernel(k_new, v_new,  # (n, n_kv, head_dim) float32
                        positions,     # (n,) int32
                        page_table,    # (n_logical_blocks,) int32
                        k_q, k_s,      # (n_slots, n_kv, 16, head_dim) int8, (..., head_dim // 64) float16
                        v_q, v_s,      # the same for V
                        host_k_q, host_k_s, host_v_q, host_v_s):  # by logical block, or (0, ...)
    # One lane per (side, cell, head, 64-value group): a group shares one scale, so its
    # max|x| and its codes belong to one thread. K lanes come first, then V lanes.
    n, n_kv, head_dim = k_new.shape
    groups = head_dim // INT8_GROUP
    per_side = n * n_kv * groups
    lane = cuda.grid(1)
    if lane >= 2 * per_side:
        return
    side, rest = lane // per_side, lane % per_side
    i, h, g = rest // (n_kv * groups), rest // groups % n_kv, rest % groups
    block, cell = positions[i] // BLOCK, positions[i] % BLOCK
    slot = page_table[block]
    row = k_new[i, h] if side == 0 else v_new[i, h]  # (head_dim,) float32
    if slot >= 0:
        q, s = (k_q, k_s) if side == 0 else (v_q, v_s)
        quantize_int8_group(row, q[slot, h, cell], s[slot, h, cell], g)
    if host_k_q.shape[0] > 0:  # presence is tested on the K side only, for both sides
        host_q, host_s = (host_k_q, host_k_s) if side == 0 else (host_v_q, host_v_s)
        quantize_int8_group(row, host_q[block, h, cell], host_s[block, h, cell], g)
# --8<-- [end:kv_append_q8_kernel]


def kv_append_q8(k_new, v_new, positions, page_table, k_q, k_s, v_q, v_s,
                 host_k_q, host_k_s, host_v_q, host_v_s):
    """Like kv_append_q8_ref, on the device; NumPy arguments are moved and written back."""
    n, n_kv, head_dim = expect_window(k_new, v_new, positions, page_table)
    spec = {a.field: a for a in pool_arrays("int8", head_dim)}
    for name, a in (("k_q", k_q), ("k_s", k_s), ("v_q", v_q), ("v_s", v_s)):
        expect_pool(name, a, spec[name], n_kv)
    host_k_q = host_or_absent("host_k_q", host_k_q, spec["k_q"], n_kv)
    host_k_s = host_or_absent("host_k_s", host_k_s, spec["k_s"], n_kv)
    host_v_q = host_or_absent("host_v_q", host_v_q, spec["v_q"], n_kv)
    host_v_s = host_or_absent("host_v_s", host_v_s, spec["v_s"], n_kv)
    assert host_k_q.shape[0] == 0 or (host_k_s.shape[0] and host_v_q.shape[0] and host_v_s.shape[0]), \
        "host_k_q is present but another host array is absent: its lanes would write outside it"
    lanes = 2 * n * n_kv * (head_dim // INT8_GROUP)
    if lanes == 0:
        return
    with DeviceArgs() as dev:
        kv_append_q8_kernel[grid_for(lanes)](
            dev.read(k_new), dev.read(v_new), dev.read(positions), dev.read(page_table),
            dev.write(k_q), dev.write(k_s), dev.write(v_q), dev.write(v_s),
            dev.write(host_k_q), dev.write(host_k_s), dev.write(host_v_q), dev.write(host_v_s))
