"""Device memory kept for reuse: Numba's allocator with a free list per size class.

Every launcher's output is a new device array (`launch.device_empty`), so a prompt chunk
allocates about 490 of them, and Numba's own allocator calls cuMemAlloc for each and
cuMemFree when it dies. Those driver calls are host time the GPU waits for: a prefill
cannot run ahead of the GPU while the host sits in cuMemAlloc.

`PooledMemory` keeps what dies instead. An allocation is rounded up to its size class
(`size_class`), and a new one takes a kept pointer of that class when there is one. The
same shapes come back every layer and every chunk, so after the first chunk almost
nothing reaches the driver. The GPU's work is the same either way; what goes is the
host's time in the driver, so the host can run ahead of the GPU again (the lesson
"Device memory kept for reuse" in docs/gpu/fast.md measures it).

Reuse is safe because every kernel and copy that touches these arrays runs in one order:
the legacy default stream, or a graph's stream, which the legacy stream waits for and is
waited for by. A pointer freed while a queued kernel still reads it is handed to a later
launch, and that launch runs after the reader. The kept memory is given back to the
driver when an allocation fails for lack of memory (then it is tried again), and when
the context is reset.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

from numba import cuda

from strata_nb.gpu.geometry import SIMULATED

SMALL = 1 << 20  # below this, sizes are rounded up to 512 bytes; above, to a quarter power of two


def size_class(nbytes: int) -> int:
    """The bytes actually allocated for nbytes: at most 25% more (above 1 MiB), 511 more below."""
    if nbytes <= SMALL:
        return (nbytes + 511) // 512 * 512
    quarter = 1 << (nbytes.bit_length() - 3)  # a quarter of the power of two at or below nbytes
    return (nbytes + quarter - 1) // quarter * quarter


def _pooled_manager():
    from numba.cuda.cudadrv import driver

    class PooledMemory(driver.NumbaCUDAMemoryManager):
        """Numba's device memory manager, with `memalloc` served from kept pointers."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kept = defaultdict(list)  # size class -> pointers free for reuse
            self.fresh = 0  # allocations that reached cuMemAlloc (the tests read it)

        # --8<-- [start:memalloc]
        def memalloc(self, size):
            nbytes = size_class(size)
            free = self.kept[nbytes]
            ptr = free.pop() if free else self._fresh(nbytes)
            key = int(ptr)
            allocations = self.allocations

            def keep():  # the array died: its pointer waits for the next allocation of its class
                allocations.pop(key, None)
                free.append(ptr)

            # As in Numba's own memalloc, `allocations` holds the pointer object until the
            # array's last view dies; without it the object (and keep) would go at once.
            mem = allocations[key] = driver.AutoFreePointer(weakref.proxy(self.context), ptr, nbytes, finalizer=keep)
            return mem.own()
        # --8<-- [end:memalloc]

        def _fresh(self, nbytes):
            self.fresh += 1
            try:
                return driver.driver.cuMemAlloc(nbytes)
            except driver.CudaAPIError as e:
                if e.code != driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                    raise
            self.give_back()  # out of memory: hand the kept pointers to the driver, try again
            return self._attempt_allocation(lambda: driver.driver.cuMemAlloc(nbytes))

        def give_back(self):
            """cuMemFree every kept pointer (those in use stay). A kept pointer may still be
            read by a queued kernel, so the GPU finishes its queue first."""
            self.context.synchronize()
            for free in self.kept.values():
                while free:
                    driver.driver.cuMemFree(free.pop())

        def reset(self):
            super().reset()
            self.kept.clear()  # the context's memory goes with it

    return PooledMemory


def install() -> None:
    """Make new CUDA contexts use PooledMemory. Under the simulator there is no driver
    memory to keep, and nothing changes."""
    if not SIMULATED:
        cuda.set_memory_manager(_pooled_manager())


def pool():
    """The current context's memory manager (PooledMemory once installed)."""
    return cuda.current_context().memory_manager
