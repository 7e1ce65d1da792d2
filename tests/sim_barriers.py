"""The CUDA simulator's barriers, woken instead of polled (tests only).

What the simulator does. numba-cuda's simulator (numba/cuda/simulator/kernel.py) runs a
thread block as one Python thread per CUDA thread. A thread at `cuda.syncthreads()` sets
a flag and sleeps on its own Event. The launching thread, the BlockManager, loops over
every live thread without sleeping, collects the flagged ones, and once every live
thread is flagged sets all their Events. The same loop sees a thread that raised (the
launch raises its exception; the others abort at their next barrier, not joined) and
threads that returned (they no longer count at later barriers). `syncthreads_count`,
`_and` and `_or` are two barriers around a read of the block's array of values.

Why that is slow. The loop takes its turn with the GIL at every switch (conftest makes
one every 1e-4 s) while the threads it waits for wait theirs, and the Events set at
once wake every thread together, all wanting the GIL. Every warp_sum under the
simulator is a block-wide barrier (gpu/reduce.py), so the kernel tests spend most of
their time here.

What this changes. The launching thread sleeps until every thread has returned or one
has raised. The last thread to arrive at a barrier, or the last to return while the rest
wait, opens it: the waiting threads are woken one at a time, each by the one before, so
few want the GIL at once. A barrier of 32 threads takes about 0.5 ms instead of 2-3.5,
one of 256 about 8 ms instead of 15-23. And the Python threads are kept: starting one
costs about 150 us, more than many CUDA threads' work, so a thread that has played one
CUDA thread waits in a pool to play the next (a block takes as many as it has CUDA
threads, the pool making more when it has too few). The rest is the simulator's own
code: the same reductions, the failing thread's exception ("tid=[..] ctaid=[..]: ...")
raised by the launch.

Installed by tests/conftest.py under the simulator, only over the kernel.py it was
written against (a hash of its source); STRATA_NB_SIM_BARRIERS=plain leaves the
simulator as it is, for timing one against the other.
"""
import hashlib
import inspect
from contextlib import contextmanager
import os
import threading
import warnings

import numpy as np
from numba.cuda.simulator import kernel

# sha256 of numba-cuda 0.30.4's numba/cuda/simulator/kernel.py
WRITTEN_AGAINST = "2202a5fb0922cb217547976ae2afcfb36917c71492f64f81fae32d149b670175"
PLAIN = kernel.BlockManager  # the simulator's own


class WokenThread(kernel.BlockThread):
    """A Python thread that plays one CUDA thread after another: `play` gives it the next."""

    def __init__(self):
        threading.Thread.__init__(self, daemon=True)
        self.gate = threading.Lock()  # held while this thread may not pass its barrier
        self.gate.acquire()
        self.next = None  # the thread this one wakes when it passes
        self.given = threading.Lock()  # held until play() gives it a CUDA thread
        self.given.acquire()
        self.start()

    def play(self, manager, target, grid_point, point, after):
        """What BlockThread.__init__ sets, for this CUDA thread. It runs once `given` is
        released (the launch releases the block's first thread), and then releases
        `after`, the block's next thread (or None)."""
        self._manager, self.debug = manager, manager._debug
        self.blockIdx, self.threadIdx = kernel.Dim3(*grid_point), kernel.Dim3(*point)
        x, y, _ = manager._block_dim
        self.thread_id = point[0] + x * (point[1] + y * point[2])
        self.exception, self.abort, self.next = None, False, None
        self.next_given = after.given if after is not None else None
        self._target, self._args, self._kwargs = target, (), {}
        if self.debug:
            self._target = kernel_with_errors_raised(target)

    def run(self):
        while True:
            self.given.acquire()
            if self.next_given is not None:  # the next CUDA thread of the block starts as this one does
                self.next_given.release()
            kernel.BlockThread.run(self)  # the kernel; an exception is kept in self.exception
            manager, exception = self._manager, self.exception
            IDLE.append(self)  # before it counts as returned, so the next block finds it
            manager.returned(exception)

    def syncthreads(self):  # syncthreads_count/and/or call it too
        block = self._manager
        with block.lock:
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            block.waiting.append(self)
            if len(block.waiting) == block.live:  # the last to arrive opens it
                block.open_barrier()
        self.gate.acquire()
        if self.next is not None:
            self.next.gate.release()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")


IDLE: list[WokenThread] = []  # the pool: threads waiting for play()


def kernel_with_errors_raised(target):  # BlockThread's debug wrapper
    def debug_wrapper():
        np.seterr(divide="raise")
        target()

    return debug_wrapper


class WokenBlockManager(PLAIN):
    def run(self, grid_point, *args):
        self.start(grid_point, *args)
        self.finish()

    def start(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        self.lock = threading.Lock()  # guards the three below
        self.live = len(points)  # threads not yet returned: the ones a barrier waits for;
        # counted before any starts, so none passes a barrier early
        self.waiting = []  # threads at the barrier not yet opened, in the order they came
        self.failed = None  # the first exception a thread raised, with its traceback
        self.over = threading.Event()  # set when every thread has returned, or one raised

        def target():
            self._f(*args)

        threads = [IDLE.pop() if IDLE else WokenThread() for _ in points]
        for t, p, after in zip(threads, points, threads[1:] + [None]):
            t.play(self, target, grid_point, p, after)
        threads[0].given.release()
        self.threads = threads

    def finish(self):
        self.over.wait()
        with self.lock:
            if self.failed is not None:
                for t in self.threads:  # the others raise at their next barrier, or now if at one
                    t.abort = True
                self.open_barrier()
                raise self.failed[0].with_traceback(self.failed[1])

    def open_barrier(self):  # with self.lock held
        """Wake the waiting threads one after another, each woken by the one before: woken
        all at once, every one of them would contend for the GIL at the same time."""
        chain, self.waiting = self.waiting, []
        for a, b in zip(chain, chain[1:] + [None]):
            a.next = b
        if chain:
            chain[0].gate.release()

    def returned(self, exception):
        with self.lock:
            self.live -= 1
            if exception and self.failed is None:
                self.failed = exception
                self.over.set()
            elif self.waiting and len(self.waiting) == self.live:  # the rest wait for no one
                self.open_barrier()
            if not self.live:
                self.over.set()


class ConcurrentBlocks(WokenBlockManager):
    """Every thread block of a launch at once, as on a GPU whose grid fits: the launch
    starts each block and waits for them all at its last. The simulator runs one block
    after another, so a kernel whose blocks wait for each other (the megakernel's grid
    barrier, fast/mega/interpreter.py) would wait forever there. A block that raises
    leaves the others waiting at their grid barrier: the launch raises its exception."""

    started: list = []  # this launch's blocks so far

    def run(self, grid_point, *args):
        self.start(grid_point, *args)
        ConcurrentBlocks.started.append(self)
        if tuple(grid_point) == tuple(n - 1 for n in self._grid_dim):  # the launch's last block
            blocks, ConcurrentBlocks.started = ConcurrentBlocks.started, []
            for block in blocks:
                block.finish()


@contextmanager
def concurrent_blocks():
    """Within it, the simulator runs a launch's thread blocks at once (ConcurrentBlocks)."""
    assert kernel.BlockManager is WokenBlockManager, "install() first: the woken barriers run the blocks"
    kernel.BlockManager = ConcurrentBlocks
    try:
        yield
    finally:
        kernel.BlockManager = WokenBlockManager


def install() -> bool:
    """Make the simulator launch blocks with WokenBlockManager; False, with a warning,
    where the installed simulator is not the one this was written against."""
    if os.environ.get("STRATA_NB_SIM_BARRIERS") == "plain":
        return False
    if hashlib.sha256(inspect.getsource(kernel).encode()).hexdigest() != WRITTEN_AGAINST:
        import numba_cuda

        warnings.warn(f"tests/sim_barriers.py was written against numba-cuda 0.30.4's simulator; "
                      f"numba-cuda {numba_cuda.__version__}'s kernel.py differs, so the simulator "
                      "keeps its own (polled) barriers. Read it again, then update WRITTEN_AGAINST.",
                      stacklevel=2)
        return False
    kernel.BlockManager = WokenBlockManager  # FakeCUDAKernel.__call__ makes one a block
    return True
