"""Plain twin: kernels/step/argmax.py argmax_kernel, launched as dependent
(fast/dependent_launch.py): its thread blocks are placed while the kernel before it (the
logits' product) still runs, and wait for it at their first instruction.

The code is the plain kernel's, inlined (twins.py: inline_body), and the launcher is the
plain launcher's (twins.py: relaunch), so the pick is the plain kernel's, index for index.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.fast.twins import inline_body, relaunch, twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.kernels.step import argmax as plain

# --8<-- [start:argmax_twin]
argmax_body = inline_body(plain.argmax_kernel)


@waits_for_inputs
@cuda.jit(cache=True)
def argmax_kernel(logits, part_value, part_index, arrivals, out):  # as plain.argmax_kernel
    """Plain twin: kernels/step/argmax.py argmax_kernel, launched as dependent."""
    wait_for_inputs()
    let_next_start()
    argmax_body(logits, part_value, part_index, arrivals, out)


argmax = twin_of(plain.argmax)(relaunch(plain.argmax, argmax_kernel=argmax_kernel))
# --8<-- [end:argmax_twin]
