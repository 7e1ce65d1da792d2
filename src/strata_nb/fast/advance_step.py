"""Plain twin: none; the host path's decode loop (Engine.tokens_after) keeps the token and
the position in Python. This is the last launch of a graph-replayed decode step: it moves
the step's inputs on by one token.

A captured graph takes no new arguments, so what changes from one token to the next lives
in device memory: `token` (the id going in; argmax has just written the greedy pick over
it) and `pos` (its position). This kernel copies the pick into `chosen`, a mapped host
array, so the host learns the token without a separate copy, and advances `pos`. One thread.

`chosen` is a ring: the step at position p writes slot p % len(chosen). So while the host
reads one step's pick, the steps queued after it (engine/decode_step.py: run_ahead) write
other slots.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.gpu.launch import DeviceArgs, expect, stream


# --8<-- [start:advance_step_ref]
def advance_step_ref(token,   # (1,) int32: the next step's input, already the greedy pick
                     pos,     # (1,) int32: the position of the step just run, written + 1
                     chosen):  # (R,) int32 host-visible: slot pos % R written
    chosen[pos[0] % chosen.shape[0]] = token[0]
    pos[0] += 1
# --8<-- [end:advance_step_ref]


# --8<-- [start:advance_step_kernel]
@waits_for_inputs
@cuda.jit(cache=True)
def advance_step_kernel(token, pos, chosen):  # shapes as advance_step_ref
    wait_for_inputs()
    let_next_start()  # a dependent launch: fast/dependent_launch.py
    if cuda.grid(1) == 0:
        chosen[pos[0] % chosen.shape[0]] = token[0]
        pos[0] += 1
# --8<-- [end:advance_step_kernel]


def advance_step(token, pos, chosen):
    """Like advance_step_ref, on the device."""
    for name, a, shape in (("token", token, (1,)), ("pos", pos, (1,)), ("chosen", chosen, (None,))):
        expect(name, a, np.int32, shape)
    with DeviceArgs() as dev:
        advance_step_kernel[1, 1, stream()](dev.read(token), dev.write(pos), dev.write(chosen))
