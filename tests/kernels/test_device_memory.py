"""The pooled device allocator (gpu/device_memory.py): sizes round up by a bounded
amount, freed memory is reused without reaching the driver, and reuse keeps stream order:
a kernel queued before the free still reads the old contents."""
import gc

import numpy as np
import pytest
from numba import cuda

from conftest import ON_GPU
from strata_nb.gpu.device_memory import pool, size_class
from strata_nb.gpu.launch import device_empty


def test_size_class_rounds_up_at_most_a_quarter():
    for n in [1, 511, 512, 513, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 4_718_592, 25_165_824, 123_456_789]:
        c = size_class(n)
        assert c >= n
        assert c - n < 512 if n <= 1 << 20 else c <= 1.25 * n
        assert size_class(c) == c  # a class is its own class: kept pointers fit their sizes
    assert size_class(5 << 20) == 5 << 20  # 1.25 x 4 MiB: a class
    assert size_class(4_718_592) == 5 << 20  # 2048 x 576 float32 (4.5 MiB) takes the next class
    assert {size_class(n) for n in range(1 << 22, 1 << 23, 4099)} == {m << 20 for m in (4, 5, 6, 7, 8)}


@cuda.jit
def _slow_copy(src, dst, spins):
    i = cuda.grid(1)
    if i < src.size:
        acc = 0.0
        for _ in range(spins):  # keeps the kernel running while the host frees and reallocates
            acc += 1e-30
        dst[i] = src[i] + acc


@cuda.jit
def _fill(a, value):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = value


@pytest.mark.skipif(not ON_GPU, reason="the pool manages driver memory; the simulator has none")
def test_freed_memory_is_reused_in_stream_order():
    n = 1 << 16
    manager = pool()
    src = device_empty((n,), np.float32)
    _fill[n // 128, 128](src, 7.0)
    dst = device_empty((n,), np.float32)
    address = src.device_ctypes_pointer.value
    _slow_copy[n // 128, 128](src, dst, 20000)  # still reading src when it is freed below
    del src
    gc.collect()  # should an array sit in a reference cycle, its memory waits for the collector
    fresh = manager.fresh
    again = device_empty((n,), np.float32)
    assert again.device_ctypes_pointer.value == address  # the freed pointer, not the driver's
    assert manager.fresh == fresh
    _fill[n // 128, 128](again, -1.0)  # queued after the reader: it cannot overwrite what it reads
    assert (dst.copy_to_host() == 7.0).all()
    assert (again.copy_to_host() == -1.0).all()
    del again
    gc.collect()
    manager.give_back()  # what an allocation that fails for lack of memory does first
    assert not any(manager.kept.values())
    assert device_empty((n,), np.float32) is not None and manager.fresh == fresh + 1  # from the driver again
