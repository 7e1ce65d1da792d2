"""The KV writers' fast twins: the plain append kernels launched as dependent.

Plain twins: kernels/kv/kv_append_k8v4.py kv_append_k8v4_kernel and kernels/kv/key_sketch.py
key_sketch_kernel. Each twin is its plain kernel's code (`inline_body`: the same device
code, so the one writer stays one: the host copy always, the VRAM slot when resident),
with the wait for the kernel before it at its first instruction and the next kernel let
start at once (fast/dependent_launch.py). What it buys: in a decode step the append's
launch overlaps the end of the q|k|v matvec before it, and the next kernel's launch its own.
Their launchers are the plain launchers' code (`relaunch`), so the checks, grids and
arguments are written once.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.fast.twins import inline_body, relaunch, twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.kernels.kv import key_sketch as plain_sketch
from strata_nb.kernels.kv import kv_append_k8v4 as plain_k8v4

_k8v4_body = inline_body(plain_k8v4.kv_append_k8v4_kernel)
_sketch_body = inline_body(plain_sketch.key_sketch_kernel)


@waits_for_inputs
@cuda.jit(cache=True)
def kv_append_k8v4_kernel(q8_warps, append_threads,
                          k8_k, k8_v, k8_pos, k8_table, k_q, k_s, k_q_v, k_s_v,
                          k8_host_q, k8_host_s, k8_host_q_v, k8_host_s_v,
                          v4_k, v4_v, v4_pos, v4_table, v_q4, v_d, v_q4_v, v_d_v,
                          v4_host_q4, v4_host_d, v4_host_q4_v, v4_host_d_v, v4_rotate,
                          sketch, sketch_d):
    """Plain twin: kernels/kv/kv_append_k8v4.py kv_append_k8v4_kernel, launched as dependent."""
    wait_for_inputs()
    let_next_start()
    _k8v4_body(q8_warps, append_threads,
               k8_k, k8_v, k8_pos, k8_table, k_q, k_s, k_q_v, k_s_v,
               k8_host_q, k8_host_s, k8_host_q_v, k8_host_s_v,
               v4_k, v4_v, v4_pos, v4_table, v_q4, v_d, v_q4_v, v_d_v,
               v4_host_q4, v4_host_d, v4_host_q4_v, v4_host_d_v, v4_rotate,
               sketch, sketch_d)


@waits_for_inputs
@cuda.jit(cache=True)
def key_sketch_kernel(k_new, positions, sketch, sketch_d):
    """Plain twin: kernels/kv/key_sketch.py key_sketch_kernel, launched as dependent."""
    wait_for_inputs()
    let_next_start()
    _sketch_body(k_new, positions, sketch, sketch_d)


kv_append_k8v4 = twin_of(plain_k8v4.kv_append_k8v4)(
    relaunch(plain_k8v4.kv_append_k8v4, kv_append_k8v4_kernel=kv_append_k8v4_kernel))
key_sketch = twin_of(plain_sketch.key_sketch)(relaunch(plain_sketch.key_sketch, key_sketch_kernel=key_sketch_kernel))
