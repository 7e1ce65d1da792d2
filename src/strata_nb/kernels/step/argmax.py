"""Greedy sampling on the device: the index of each row's largest logit, the first one
where several are equal (as np.argmax), so only 4 bytes cross back to the host per row.

The row is cut into chunks of SPAN logits, one thread block each (24 for the default
model's 49,152), so the loads are spread over the GPU, not queued on one SM. A thread
loads its PER_THREAD logits of the chunk (neighbouring threads on neighbouring logits)
before it compares any, so they are in flight together, then keeps the largest and that
value's first index (strictly greater replaces, so an equal value later in its share
never does). Two block reductions (gpu/reduce.py) give the chunk's max and, among the
threads that hold it, the smallest index, computed as -max(-index) in float32, exact
for indices below 2^24. The block that arrives last (gpu/launch.py: last_to_arrive)
reduces the chunks' results the same way and writes the row's index.

The result is an index, so the kernel must equal the reference exactly. Rows are
finite logits: np.argmax would return the first NaN, the kernel never picks a NaN.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import DeviceArgs, device_empty, expect, last_to_arrive, stream, ticket_counters
from strata_nb.gpu.geometry import ARGMAX_THREADS
from strata_nb.gpu.reduce import NEG_INF, block_max

# Threads per chunk: 256 on a GPU; 64 under the simulator, where every thread is a
# Python thread. A chunk is THREADS * PER_THREAD logits: 2,048 on a GPU.
THREADS = ARGMAX_THREADS
PER_THREAD = 8
SPAN = THREADS * PER_THREAD
MAX_VOCAB = 1 << 24  # indices travel through float32 in the second reduction


# --8<-- [start:argmax_ref]
def argmax_ref(logits,  # (n, vocab) float32
               out):    # (n,) int32, written
    out[...] = np.argmax(logits, axis=-1)
# --8<-- [end:argmax_ref]


# --8<-- [start:argmax_kernel]
@cuda.jit(device=True)
def first_of_max(best, best_j, vocab):
    """Over the thread block: the largest `best`, and the smallest `best_j` holding it."""
    top = block_max(best)
    candidate = float32(best_j) if best == top else float32(vocab)
    return top, int(-block_max(-candidate))


@cuda.jit(cache=True)
def argmax_kernel(logits,      # (n, vocab) float32
                  part_value,  # (n, chunks) float32 scratch: each chunk's max
                  part_index,  # (n, chunks) int32 scratch: its first index
                  arrivals,    # (n,) int32: 0 before the launch, 0 after it
                  out):        # (n,) int32, written
    i, chunk, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    vocab = logits.shape[1]
    first_j = chunk * SPAN + t
    values = cuda.local.array(PER_THREAD, float32)
    for u in range(PER_THREAD):  # every load in flight before the first comparison
        j = first_j + u * THREADS
        values[u] = logits[i, j] if j < vocab else NEG_INF
    best, best_j = NEG_INF, vocab  # vocab = "no value yet"
    for u in range(PER_THREAD):
        j = first_j + u * THREADS
        if j < vocab and (values[u] > best or best_j == vocab):  # the first value always counts, even -inf
            best, best_j = values[u], j
    top, first = first_of_max(best, best_j, vocab)
    if t == 0:
        part_value[i, chunk], part_index[i, chunk] = top, first
    if last_to_arrive(arrivals, i, cuda.gridDim.y) == 0:
        return
    # The last block: thread c takes chunk c's result (the launcher keeps chunks <= THREADS).
    best, best_j = NEG_INF, vocab
    if t < cuda.gridDim.y:
        best, best_j = part_value[i, t], part_index[i, t]
    top, first = first_of_max(best, best_j, vocab)
    if t == 0:
        out[i] = first
# --8<-- [end:argmax_kernel]


def argmax(logits, out):
    """Like argmax_ref, on the device. NumPy arguments are moved (out is written back)."""
    expect("logits", logits, np.float32, (None, None))
    n, vocab = logits.shape
    assert 0 < vocab < MAX_VOCAB, f"vocab {vocab} is not in [1, 2^24)"
    expect("out", out, np.int32, (n,))
    if n == 0:
        return
    chunks = -(-vocab // SPAN)
    assert chunks <= THREADS, f"vocab {vocab} is over {THREADS} chunks of {SPAN}: the last block takes one each"
    part_value, part_index = device_empty((n, chunks), np.float32), device_empty((n, chunks), np.int32)
    with DeviceArgs() as dev:
        argmax_kernel[(n, chunks), THREADS, stream()](
            dev.read(logits), part_value, part_index, ticket_counters("argmax", (n,)), dev.write(out))
