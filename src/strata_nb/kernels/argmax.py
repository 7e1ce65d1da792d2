"""Greedy sampling on the device: the index of each row's largest logit, the first one
where several are equal (as np.argmax), so only 4 bytes cross back to the host per row.

One thread block per row. Each thread walks a strided share of the row (coalesced),
keeping its largest value and that value's first index (strictly greater replaces, so an
equal value later in its share never does). Then two block reductions (reduce.py): the
row's max, and among the threads that hold it the smallest index, computed as
-max(-index) in float32, exact for indices below 2^24.

The result is an index, so the kernel must equal the reference exactly. Rows are
finite logits: np.argmax would return the first NaN, the kernel never picks a NaN.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda, float32

from strata_nb.kernels.launch import DeviceArgs, expect, stream
from strata_nb.kernels.reduce import NEG_INF, block_max

# Threads per row: 1024 on a GPU (49152 logits = 48 per thread); 64 under the simulator,
# where every thread is a Python thread.
THREADS = 64 if config.ENABLE_CUDASIM else 1024
MAX_VOCAB = 1 << 24  # indices travel through float32 in the second reduction


# --8<-- [start:argmax_ref]
def argmax_ref(logits,  # (n, vocab) float32
               out):    # (n,) int32, written
    out[...] = np.argmax(logits, axis=-1)
# --8<-- [end:argmax_ref]


# --8<-- [start:argmax_kernel]
@cuda.jit
def argmax_kernel(logits, out):  # shapes as argmax_ref
    i, t = cuda.blockIdx.x, cuda.threadIdx.x
    vocab = logits.shape[1]
    best, best_j = NEG_INF, vocab  # vocab = "no value yet"
    for j in range(t, vocab, cuda.blockDim.x):
        v = logits[i, j]
        if v > best or best_j == vocab:  # the first value always counts, even -inf
            best, best_j = v, j
    top = block_max(best)
    candidate = float32(best_j) if best == top else float32(vocab)
    first = -block_max(-candidate)  # the smallest index holding the top value
    if t == 0:
        out[i] = int(first)
# --8<-- [end:argmax_kernel]


def argmax(logits, out):
    """Like argmax_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("logits", logits, np.float32, (None, None))
    n, vocab = logits.shape
    assert 0 < vocab < MAX_VOCAB, f"vocab {vocab} is not in [1, 2^24)"
    expect("out", out, np.int32, (n,))
    if n == 0:
        return
    with DeviceArgs() as dev:
        argmax_kernel[n, THREADS, stream()](dev.read(logits), dev.write(out))
