"""The last launch of a replayable decode step: move the step's inputs on by one token.

A captured graph takes no new arguments, so what changes from one token to the next lives
in device memory: `token` (the id going in; argmax has just written the greedy pick over
it) and `pos` (its position). This kernel advances `pos` and copies the pick into `chosen`,
a mapped host array, so the host learns the token without a separate copy. One thread.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.kernels.launch import DeviceArgs, expect, stream


# --8<-- [start:advance_step_ref]
def advance_step_ref(token,   # (1,) int32: the next step's input, already the greedy pick
                     pos,     # (1,) int32: the position of the step just run, written + 1
                     chosen):  # (1,) int32 host-visible, written
    chosen[0] = token[0]
    pos[0] += 1
# --8<-- [end:advance_step_ref]


# --8<-- [start:advance_step_kernel]
@cuda.jit
def advance_step_kernel(token, pos, chosen):  # shapes as advance_step_ref
    if cuda.grid(1) == 0:
        chosen[0] = token[0]
        pos[0] += 1
# --8<-- [end:advance_step_kernel]


def advance_step(token, pos, chosen):
    """Like advance_step_ref, on the device."""
    for name, a in (("token", token), ("pos", pos), ("chosen", chosen)):
        expect(name, a, np.int32, (1,))
    with DeviceArgs() as dev:
        advance_step_kernel[1, 1, stream()](dev.read(token), dev.write(pos), dev.write(chosen))
