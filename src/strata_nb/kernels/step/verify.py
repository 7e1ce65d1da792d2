"""Speculative decoding's check: how many drafted tokens the model agrees with.

A verify window is one forward pass over T positions: the token at pos, then T - 1
tokens a drafter guessed for pos + 1, ... (engine/draft.py). Row i of its logits is the
model's prediction for the token after row i's, so the model agrees with draft i when
row i's greedy pick is draft i. The longest such prefix is kept, plus the model's own
pick after it: row `kept`'s, which is right because every token before it was.

On the device this is two launches: the plain argmax (argmax.py) writes each row's pick,
then one thread compares picks and drafts in order and stops at the first that differ.
T is a handful (--spec is at most 8), so one thread's walk is the whole of the work.
Picks and kept are integers: the kernel must equal the reference exactly.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.kernels.step.argmax import argmax, argmax_ref


# --8<-- [start:verify_ref]
def verify_ref(logits,  # (T, vocab) float32: the window's rows
               drafts,  # (T - 1,) int32: the drafted tokens, draft i for row i
               picks,   # (T,) int32, written: each row's greedy pick (the first max, as np.argmax)
               kept):   # (1,) int32, written: the longest prefix of drafts equal to the picks
    argmax_ref(logits, picks)
    n = 0
    while n < len(drafts) and picks[n] == drafts[n]:
        n += 1
    kept[0] = n
# --8<-- [end:verify_ref]


# --8<-- [start:verify_kernel]
@cuda.jit(cache=True)
def kept_kernel(picks, drafts, kept):  # as verify_ref; picks already written
    if cuda.grid(1) == 0:
        n = 0
        while n < drafts.shape[0] and picks[n] == drafts[n]:
            n += 1
        kept[0] = n
# --8<-- [end:verify_kernel]


def verify(logits, drafts, picks, kept):
    """Like verify_ref, on the device. NumPy arguments are moved (picks and kept are
    written back)."""
    expect("logits", logits, np.float32, (None, None))
    T = logits.shape[0]
    assert T >= 1, "a verify window has at least the token it starts from"
    expect("drafts", drafts, np.int32, (T - 1,))
    expect("picks", picks, np.int32, (T,))
    expect("kept", kept, np.int32, (1,))
    with DeviceArgs() as dev:
        on_device = dev.write(picks)
        argmax(logits, on_device)
        kept_kernel[1, 1, stream()](on_device, dev.read(drafts), dev.write(kept))
