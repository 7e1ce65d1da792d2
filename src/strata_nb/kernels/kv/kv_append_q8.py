"""KV append for int8 pools (and the K half of k8v4): quantize each new cell, write it.

The same writer as kv_append_fp16.py (read its docstring first): VRAM slot if resident,
host copy if present, presence tested on the K-side host array (`host_k_q`) alone. Each
warp quantizes one 64-value group of one head of one cell, for K or for V, with
quant_int8's `quantize_int8_pair`, and writes the codes into each destination: one
quantization, so the pool and the host copy get the same bytes.

k8v4 calls this with its K half FOLDED: `k_q = v_q = pool.k_q`, `host_k_q = host_v_q =
host.k_q` (and the scales likewise), `k_new = v_new = k`. The V warps then rewrite the
identical K bytes, and the K-side presence test sees the real host array.
`_ref` and the launcher take the same arguments and both write the given arrays in place.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect_pool, expect_window, grid_for, host_or_absent
from strata_nb.kernels.kv.quant_int8 import quantize_int8_pair, quantize_int8_ref
from strata_nb.gpu.reduce import WARP
from strata_nb.kv_layout import BLOCK, INT8_GROUP, pool_arrays


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
@cuda.jit(device=True)
def append_q8_warp(unit, lane,        # this warp's index among the launch's q8 warps, its lane
                   k_new, v_new,      # (n, n_kv, head_dim) float32
                   positions,         # (n,) int32
                   page_table,        # (n_logical_blocks,) int32
                   k_q, k_s,          # (n_slots, n_kv, 16, head_dim) int8, (..., head_dim // 64) float16
                   v_q, v_s,          # the same for V
                   host_k_q, host_k_s, host_v_q, host_v_s):  # by logical block, or (0, ...)
    # One warp per (side, cell, head, 64-value group): a group shares one scale, found by
    # the warp together (quantize_int8_pair); lane l writes codes 2l and 2l + 1, so the
    # warp's 64 codes go out as one contiguous run, which matters most for the host copy
    # across the bus. K warps come first, then V warps. Warps past the last group redo
    # the last one without writing: warp_max needs every lane of the block.
    n, n_kv, head_dim = k_new.shape
    groups = head_dim // INT8_GROUP
    per_side = n * n_kv * groups
    writes = unit < 2 * per_side
    unit = min(unit, 2 * per_side - 1)
    side, rest = unit // per_side, unit % per_side
    i, h, g = rest // (n_kv * groups), rest // groups % n_kv, rest % groups
    block, cell = positions[i] // BLOCK, positions[i] % BLOCK
    slot = page_table[block]
    code0, code1, scale = quantize_int8_pair(k_new[i, h] if side == 0 else v_new[i, h], g, lane)
    j = g * INT8_GROUP + 2 * lane
    if writes and slot >= 0:
        q, s = (k_q, k_s) if side == 0 else (v_q, v_s)
        q[slot, h, cell, j], q[slot, h, cell, j + 1] = code0, code1
        if lane == 0:
            s[slot, h, cell, g] = scale
    if writes and host_k_q.shape[0] > 0:  # presence is tested on the K side only, for both sides
        host_q, host_s = (host_k_q, host_k_s) if side == 0 else (host_v_q, host_v_s)
        host_q[block, h, cell, j], host_q[block, h, cell, j + 1] = code0, code1
        if lane == 0:
            host_s[block, h, cell, g] = scale


@cuda.jit(cache=True)
def kv_append_q8_kernel(k_new, v_new, positions, page_table, k_q, k_s, v_q, v_s,
                        host_k_q, host_k_s, host_v_q, host_v_s):  # append_q8_warp's arrays
    append_q8_warp(cuda.grid(1) // WARP, cuda.threadIdx.x % WARP, k_new, v_new, positions, page_table,
                   k_q, k_s, v_q, v_s, host_k_q, host_k_s, host_v_q, host_v_s)
# --8<-- [end:kv_append_q8_kernel]


def q8_launch(dev, k_new, v_new, positions, page_table, k_q, k_s, v_q, v_s,
              host_k_q, host_k_s, host_v_q, host_v_s) -> tuple[int, tuple]:
    """Check kv_append_q8's arguments; return its lanes (a warp per group, 0 = nothing to
    write) and the kernel's arguments, moved by `dev` (a DeviceArgs)."""
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
    lanes = 2 * n * n_kv * (head_dim // INT8_GROUP) * WARP  # a warp per group
    return lanes, (dev.read(k_new), dev.read(v_new), dev.read(positions), dev.read(page_table),
                   dev.write(k_q), dev.write(k_s), dev.write(v_q), dev.write(v_s),
                   dev.write(host_k_q), dev.write(host_k_s), dev.write(host_v_q), dev.write(host_v_s))


def kv_append_q8(k_new, v_new, positions, page_table, k_q, k_s, v_q, v_s,
                 host_k_q, host_k_s, host_v_q, host_v_s):
    """Like kv_append_q8_ref, on the device; NumPy arguments are moved and written back."""
    with DeviceArgs() as dev:
        lanes, args = q8_launch(dev, k_new, v_new, positions, page_table, k_q, k_s, v_q, v_s,
                                host_k_q, host_k_s, host_v_q, host_v_s)
        if lanes:
            kv_append_q8_kernel[grid_for(lanes)](*args)
