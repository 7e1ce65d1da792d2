"""KV append for k8v4: K as int8, rotated V as q4_0, through the two single-format writers.

V arrives as the q|k|v projection made it, unrotated: the V half's warps rotate each head row
themselves before they quantize it (kv_append_q4.py, `rotate`), so a k8v4 layer needs no
Hadamard launch. `v_rotated=True` takes V already rotated by the hadamard kernel instead,
as the q4_0 format's writer does; a test shows both give the same bytes.

k8v4 has no quantizer of its own. Its K half goes through kv_append_q8 and its V half
through kv_append_q4. Each of those writes a K side and a V side and tests the K-side
host array for presence; a k8v4 half has only one side, so each half is passed FOLDED:
both sides name the same arrays and the same input. The second side's lanes rewrite
identical bytes (a little wasted work), and the K-side presence test sees the half's
real host array.

On the device the two halves are one launch (`kv_append_k8v4_kernel`): its first warps
run kv_append_q8's warp body (`append_q8_warp`) on the K half's arguments, the rest
kv_append_q4's (`append_q4_warp`) on the V half's, each checked by its own writer's
launcher (`q8_launch`, `q4_launch`). The same arithmetic and the same writes as the two
launches in one: the GPU time stays what the two took, and a decode step has one launch
fewer a layer.

With QSA, the same launch also keeps the key sketch (`sketch`, kernels/kv/key_sketch.py):
thread blocks after the two halves' run key_sketch's body, so a streamed step has no
separate key_sketch launch a layer. Those thread blocks are whole blocks of their own,
because every warp reduction, under the simulator, waits for every thread of its thread
block.

`fold_v_half=False` passes the V half the tempting way instead: the pool still folded,
but the host copy given only as the V-side array. The K-side test then finds no host
copy and skips every host write of V, silently. A V cell whose block is not resident
is then written nowhere; one whose block is resident lives only in its VRAM slot until
the slot is evicted. Either way attention later reads zeros for V from the host copy,
and generation degrades while nothing crashes (docs/design.md, "The host copy and the
one writer"). It exists as the teaching fault that tests/kernels/test_kv_hybrid_parity.py
must catch; the engine never sets it.

Backend choice: `kv_append_k8v4_ref` (NumPy, the engine's numpy backend) and
`kv_append_k8v4` (the kernels) take the same arguments, like every module here.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.kernels.kv.key_sketch import LANES, key_sketch_ref, sketch_group, sketch_launch
from strata_nb.kernels.kv.kv_append_q4 import append_q4_warp, kv_append_q4_ref, q4_launch
from strata_nb.kernels.kv.kv_append_q8 import append_q8_warp, kv_append_q8_ref, q8_launch
from strata_nb.gpu.launch import THREADS, DeviceArgs, absent, grid_for, view_bytes
from strata_nb.gpu.reduce import WARP


# --8<-- [start:append_halves]
def append_halves(append_q8, append_q4,  # the q8 and q4 writers: both refs or both kernels
                  k,           # (n, n_kv, head_dim) float32, roped
                  v,           # (n, n_kv, head_dim) float32
                  rotate_v,    # True: v is unrotated and the q4 writer rotates it
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
        append_q4(v, v, positions, page_table,
                  pool["v_q4"], pool["v_q4"], host["v_q4"], host["v_q4"], rotate_v)
    else:
        # The teaching fault: only the V-side host array; the K side looks absent.
        append_q4(v, v, positions, page_table,
                  pool["v_q4"], pool["v_q4"], np.empty((0,), np.uint8), host["v_q4"], rotate_v)
# --8<-- [end:append_halves]


def kv_append_k8v4_ref(k, v, positions, page_table, pool, host, *, fold_v_half=True, sketch=None,
                       v_rotated=False):
    """The k8v4 append with the NumPy writers; pool and host are written in place.
    sketch: QSA's key sketch, its cells written as key_sketch does, or None.
    v_rotated: v arrives Hadamard-rotated already (else the V half rotates it)."""
    append_halves(kv_append_q8_ref, kv_append_q4_ref, k, v, not v_rotated, positions, page_table,
                  pool, host, fold_v_half)
    if sketch is not None:
        key_sketch_ref(k, positions, sketch)


# --8<-- [start:kv_append_k8v4_kernel]
@cuda.jit(cache=True)
def kv_append_k8v4_kernel(q8_warps,        # int32: warps of the K half; the V half's come after them
                          append_threads,  # int32: the threads of both halves' thread blocks
                          k8_k, k8_v, k8_pos, k8_table, k_q, k_s, k_q_v, k_s_v,  # append_q8_warp's arrays:
                          k8_host_q, k8_host_s, k8_host_q_v, k8_host_s_v,        # the K half, folded
                          v4_k, v4_v, v4_pos, v4_table, v_q4, v_d, v_q4_v, v_d_v,  # append_q4_warp's
                          v4_host_q4, v4_host_d, v4_host_q4_v, v4_host_d_v, v4_rotate,  # arrays: the V half
                          sketch, sketch_d):  # QSA's key sketch (key_sketch), or (0, ...) when not kept
    thread = cuda.grid(1)
    if thread >= append_threads:  # thread blocks of their own: the sketch's warps
        t = thread - append_threads
        sketch_group(t // LANES, t % LANES, k8_k, k8_pos, sketch, sketch_d)
        return
    unit, lane = thread // WARP, cuda.threadIdx.x % WARP  # a half's warps never straddle
    if unit < q8_warps:
        append_q8_warp(unit, lane, k8_k, k8_v, k8_pos, k8_table, k_q, k_s, k_q_v, k_s_v,
                       k8_host_q, k8_host_s, k8_host_q_v, k8_host_s_v)
    else:
        append_q4_warp(unit - q8_warps, lane, v4_k, v4_v, v4_pos, v4_table, v_q4, v_d, v_q4_v, v_d_v,
                       v4_host_q4, v4_host_d, v4_host_q4_v, v4_host_d_v, v4_rotate)
# --8<-- [end:kv_append_k8v4_kernel]


def kv_append_k8v4(k, v, positions, page_table, pool, host, *, fold_v_half=True, sketch=None,
                   v_rotated=False):
    """The k8v4 append with the kernels, both halves and the key sketch in one launch; pool,
    host and sketch are written in place."""
    halves = {}
    append_halves(lambda *a: halves.setdefault("q8", a), lambda *a: halves.setdefault("q4", a),
                  k, v, not v_rotated, positions, page_table, pool, host, fold_v_half)
    with DeviceArgs() as dev:
        q8_lanes, q8_args = q8_launch(dev, *halves["q8"])
        q4_lanes, q4_args = q4_launch(dev, *halves["q4"])
        if not q8_lanes:  # both halves have cells, or neither
            return
        append_threads = -(-(q8_lanes + q4_lanes) // THREADS) * THREADS
        if sketch is None:  # no QSA: no sketch threads, and size-0 arrays for the kernel's signature
            sketch_threads, keys = 0, absent((0, 1, 1, 2), np.uint8)
            keys_d = view_bytes(keys, np.float16)
        else:
            sketch_threads, (_, _, keys, keys_d) = sketch_launch(dev, k, positions, sketch)
        kv_append_k8v4_kernel[grid_for(append_threads + sketch_threads)](
            np.int32(q8_lanes // WARP), np.int32(append_threads), *q8_args, *q4_args, keys, keys_d)
