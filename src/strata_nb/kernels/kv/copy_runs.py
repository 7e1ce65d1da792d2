"""Copy whole blocks between two arrays of one run: the one kernel every KV mover uses.

A block is one contiguous byte run in each of its format's arrays (docs/design.md, "KV
cells, blocks, formats"), so moving block b of the host copy into VRAM slot s is, per run,
one copy of `run_bytes` bytes. The movers (miss fill, prompt staging, ring restore,
snapshots) loop over `runs_of(fmt)` and call this once per run with every (src, dst) pair
of the step; none of them knows a format.

Threads copy 4-byte words: every run of every format is a multiple of 16 bytes, and a word
per thread keeps neighbouring threads on neighbouring addresses (coalesced).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from strata_nb.gpu.launch import DeviceArgs, expect, grid_for


# --8<-- [start:copy_runs_ref]
def copy_runs_ref(src,        # (n_src_blocks, run_words) uint32: one run of a pool or host copy
                  dst,        # (n_dst_blocks, run_words) uint32, written
                  src_index,  # (n,) int32 which blocks to read
                  dst_index):  # (n,) int32 where each goes
    dst[dst_index] = src[src_index]
# --8<-- [end:copy_runs_ref]


# --8<-- [start:copy_runs_kernel]
@cuda.jit(cache=True)
def copy_runs_kernel(src, dst, src_index, dst_index):  # shapes as copy_runs_ref
    lane = cuda.grid(1)  # one 4-byte word of one copied block
    words = src.shape[1]
    i, w = lane // words, lane % words
    if i < src_index.shape[0]:
        dst[dst_index[i], w] = src[src_index[i], w]
# --8<-- [end:copy_runs_kernel]


def copy_runs(src, dst, src_index, dst_index):
    """Like copy_runs_ref, on NumPy, mapped-host or device arrays."""
    expect("src", src, np.uint32, (None, None))
    expect("dst", dst, np.uint32, (None, src.shape[1]))
    expect("src_index", src_index, np.int32, (None,))
    expect("dst_index", dst_index, np.int32, (src_index.shape[0],))
    n = src_index.shape[0]
    if n == 0:
        return
    with DeviceArgs() as dev:
        copy_runs_kernel[grid_for(n * src.shape[1])](dev.read(src), dev.write(dst), dev.read(src_index),
                                                     dev.read(dst_index))


def as_words(a):
    """A pool/host array (n_blocks, n_kv, BLOCK, ...) as (n_blocks, run_words) uint32."""
    if isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__"):
        a = cuda.as_cuda_array(a)  # a mapped host copy: numba-cuda 0.30 cannot view() it directly
    return a.reshape(a.shape[0], a.size // a.shape[0]).view(np.uint32)
