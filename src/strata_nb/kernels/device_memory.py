"""Device memory for every launcher's outputs: a caching allocator under Numba.

Every op of a prompt chunk makes its output with `device_empty` (launch.py), about 580
arrays for a 1,024-token prompt of the default model, and drops them a few ops later.
Numba's own memory manager gives each its own `cuMemAlloc`, and frees them ten at a
time with `cuMemFree`, which waits for the GPU to finish what it was given. So the host
cannot queue launches ahead of the GPU: a prefill costs the host's time plus the GPU's,
not the larger of the two. On the H200 a 1,024-token prompt took 141 ms of wall time
for 34 ms of GPU time, and cProfile put `memalloc` among the host's top costs.

`BlockCache` keeps what an array gave back, by size, and hands it to the next array of
that size: the engine makes the same shapes chunk after chunk and step after step, so
after the first chunk nothing is allocated or freed. Reusing a block is safe without a
wait because every launch and copy outside a graph capture is on one stream (the legacy
default one, launch.stream()), which runs them in the order they were queued: the
kernel that last used a block finishes before the next one that writes it starts. A
capture's arrays stay alive with its graph (launch.Capture.keep), so no replay's memory
is ever handed out.

`CachingMemoryManager` is the Numba External Memory Management plugin around it. With
`STRATA_NB_MEMORY_POOL=1` it is installed at import of launch.py, before anything makes
a CUDA context (a context takes the plugin it is created with). Under the simulator
there are no contexts and nothing is installed. When the GPU runs out, the cache's
blocks are freed and the allocation tried once more.

**Off by default: measured once, not yet verified on a GPU.** On the H200
(`tools/prefill_profile.py`, random weights of the default model's shapes, k8v4, medians
of 3) a 1,024-token prefill went from 5,371 to 9,331 tok/s with the cache, but a
4,096-token one from 16,069 to 13,124, with spreads that overlap (13,335-16,554 against
10,388-14,629). The graph-replayed step's GPU tests passed with it; its own GPU test
(`tests/kernels/test_device_memory.py`, that a dropped array's block goes to the next
array of its size) failed in that one run, and was changed after it without a GPU to
run on. Until a GPU run settles both, Numba's own manager stays the default.
"""
from __future__ import annotations

import os
import weakref
from collections import defaultdict

from numba import config

GRANULE = 512  # bytes: cuMemAlloc's alignment; sizes are cached rounded up to it


# --8<-- [start:block_cache]
class BlockCache:
    """Free device blocks by (rounded) size. `allocate(nbytes)` and `release(pointer)` are
    the driver's calls, `out_of_memory` the exception allocate raises when the device is
    full; this class only decides when they are made."""

    def __init__(self, allocate, release, out_of_memory=MemoryError):
        self.allocate, self.release, self.out_of_memory = allocate, release, out_of_memory
        self.free: dict[int, list] = defaultdict(list)  # rounded size -> free pointers
        self.hits = self.misses = 0
        self.cached_bytes = 0  # bytes held free, ready for reuse

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(GRANULE, -(-nbytes // GRANULE) * GRANULE)

    def take(self, nbytes: int):
        """(pointer, rounded size) for an array of nbytes: a cached block if one fits exactly."""
        size = self.rounded(nbytes)
        if self.free[size]:
            self.hits += 1
            self.cached_bytes -= size
            return self.free[size].pop(), size
        self.misses += 1
        try:
            return self.allocate(size), size
        except self.out_of_memory:  # the cached blocks go back to the device, then once more
            self.release_all()
            return self.allocate(size), size

    def give(self, pointer, size: int) -> None:
        """A block its array no longer uses: kept for the next array of its size."""
        self.free[size].append(pointer)
        self.cached_bytes += size

    def release_all(self) -> None:
        """Free every cached block (the device ran out, or the context is reset)."""
        for pointers in self.free.values():
            for pointer in pointers:
                self.release(pointer)
        self.free.clear()
        self.cached_bytes = 0
# --8<-- [end:block_cache]


if not config.ENABLE_CUDASIM:
    from numba import cuda
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.driver import (CudaAPIError, GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo,
                                           MemoryPointer)

    class CachingMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Numba's EMM plugin interface (version 1) over a BlockCache; host (pinned and
        mapped) memory stays with the base class."""

        def initialize(self):
            self.cache = BlockCache(driver.driver.cuMemAlloc, driver.driver.cuMemFree, CudaAPIError)

        def memalloc(self, size):
            pointer, rounded = self.cache.take(size)
            cache = self.cache
            return MemoryPointer(weakref.proxy(self.context), pointer, size,
                                 finalizer=lambda: cache.give(pointer, rounded))

        def get_memory_info(self):
            free, total = driver.driver.cuMemGetInfo()
            return MemoryInfo(free=free, total=total)

        def reset(self):
            super().reset()
            self.cache.release_all()

        @property
        def interface_version(self):
            return 1


def install() -> bool:
    """With STRATA_NB_MEMORY_POOL=1 (and not under the simulator), make
    CachingMemoryManager the manager of contexts created from now on. True if installed."""
    if config.ENABLE_CUDASIM or os.environ.get("STRATA_NB_MEMORY_POOL", "0") != "1":
        return False
    cuda.set_memory_manager(CachingMemoryManager)
    return True


def pool_in_use() -> bool:
    """Whether the current context's device arrays come from the cache (makes the context)."""
    if config.ENABLE_CUDASIM:
        return False
    return isinstance(cuda.current_context().memory_manager, CachingMemoryManager)
