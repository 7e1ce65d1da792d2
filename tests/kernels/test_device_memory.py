"""The caching allocator under device_empty (kernels/device_memory.py): its bookkeeping
with a fake driver, and on a GPU, that a dropped array's memory goes to the next array
of its size (STRATA_NB_MEMORY_POOL=1: the allocator is off by default)."""
import os

import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.kernels.device_memory import GRANULE, BlockCache


class FakeDriver:
    def __init__(self, capacity=None):
        self.next, self.live, self.freed, self.capacity = 0x1000, {}, [], capacity

    def allocate(self, size):
        if self.capacity is not None and sum(self.live.values()) + size > self.capacity:
            raise MemoryError("out of memory")
        self.next += size
        self.live[self.next] = size
        return self.next

    def release(self, pointer):
        self.freed.append(pointer)
        del self.live[pointer]


def test_a_given_block_goes_to_the_next_array_of_its_rounded_size():
    drv = FakeDriver()
    cache = BlockCache(drv.allocate, drv.release)
    a, size_a = cache.take(1000)
    assert size_a == 2 * GRANULE
    cache.give(a, size_a)
    b, _ = cache.take(1024)  # rounds to the same size: the same block
    c, size_c = cache.take(1000)  # the cache is empty again: a new block
    assert b == a and c != a and size_c == size_a
    d, size_d = cache.take(1)
    assert size_d == GRANULE and d not in (a, c)
    assert (cache.hits, cache.misses) == (1, 3) and cache.cached_bytes == 0
    assert not drv.freed  # nothing goes back to the driver while arrays come and go


def test_out_of_memory_frees_the_cache_and_tries_once_more():
    drv = FakeDriver(capacity=4 * GRANULE)
    cache = BlockCache(drv.allocate, drv.release)
    blocks = [cache.take(GRANULE) for _ in range(3)]
    for pointer, size in blocks:
        cache.give(pointer, size)
    assert cache.cached_bytes == 3 * GRANULE
    big, size = cache.take(2 * GRANULE)  # only fits once the three cached blocks are freed
    assert size == 2 * GRANULE and sorted(drv.freed) == sorted(p for p, _ in blocks)
    assert cache.cached_bytes == 0 and drv.live == {big: 2 * GRANULE}
    with pytest.raises(MemoryError):
        cache.take(3 * GRANULE)  # does not fit even with the cache empty: the error stands


@pytest.mark.skipif(not ON_GPU or os.environ.get("STRATA_NB_MEMORY_POOL") != "1",
                    reason="on a GPU with STRATA_NB_MEMORY_POOL=1 (the simulator has no device memory to cache)")
def test_on_a_gpu_a_dropped_array_is_reused():
    from strata_nb.kernels.device_memory import pool_in_use
    from strata_nb.kernels.launch import device_empty

    import gc

    from numba import cuda

    assert pool_in_use(), "the caching allocator is not the context's memory manager"
    cache = cuda.current_context().memory_manager.cache
    a = device_empty((1000,), np.float32)
    pointer = a.device_ctypes_pointer.value
    del a
    gc.collect()  # an array in a reference cycle gives its block back when the collector runs
    assert cache.cached_bytes >= 4096
    hits = cache.hits
    b = device_empty((1000,), np.float32)
    assert cache.hits == hits + 1 and b.device_ctypes_pointer.value == pointer
