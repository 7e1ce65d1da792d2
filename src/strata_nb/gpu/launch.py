"""What every launcher does before it launches: check its arrays, and move NumPy ones to
the device once each.

Launchers accept NumPy arrays or device arrays. Numba would copy a NumPy argument to the
device and back by itself, but one copy per *argument*: an array passed twice (a folded
k8v4 half passes each pool array as both its K and its V field) would become two device
buffers, and a float16 view of a q4_0 byte array (how kernels reach its `d` fields) would
be a third, each copied back over the others. `DeviceArgs` moves each NumPy array once,
so every alias and view in the kernel is the same memory, as it is on a real GPU.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import config, cuda, int32

from strata_nb.gpu import device_memory
from strata_nb.gpu.geometry import SIMULATED
from strata_nb.kv_layout import BLOCK, PoolArray

device_memory.install()  # launchers' outputs reuse freed device memory (gpu/device_memory.py)

THREADS = 128  # threads per block for the lane-per-thread kernels: a multiple of the warp
# A decode step's kernels are small by nature (one token, 3 KV heads): Numba's warning
# that a grid under-fills the GPU would print for most launches, so it is off.
config.CUDA_LOW_OCCUPANCY_WARNINGS = False


# --8<-- [start:launch_stream]
class Capture:
    """Where launches go: the default stream, or a stream being captured into a CUDA graph.

    While a capture is open, every launcher launches on its stream, every device array a
    launcher allocates (`device_empty`) is kept alive in `keep` (the graph has its address
    baked in), and a NumPy argument is an error: copying it would be a host transfer in the
    middle of the graph, with a value frozen at capture time."""

    stream = 0  # Numba's default stream
    keep: list | None = None  # allocations the open capture's graph uses


def stream():
    """The stream launchers launch on: `kernel[blocks, threads, stream()]`."""
    return Capture.stream


@contextmanager
def capturing(on_stream, keep: list):
    Capture.stream, Capture.keep = on_stream, keep
    try:
        yield
    finally:
        Capture.stream, Capture.keep = 0, None


def device_empty(shape, dtype):
    """An uninitialised device array: every launcher's outputs come from here."""
    a = cuda.device_array(shape, dtype)
    if Capture.keep is not None:
        Capture.keep.append(a)
    return a
# --8<-- [end:launch_stream]


_TICKETS: dict = {}


def ticket_counters(owner: str, shape: tuple):
    """Int32 counters for a kernel whose last-arriving thread block finishes the work (the
    step attention's merge, select_blocks' list): zeroed once, and every launch leaves them
    0 again. One set per (owner, shape), made before any graph capture uses them."""
    key = (owner, shape)
    if key not in _TICKETS:
        assert Capture.keep is None, f"{owner}'s ticket counters are made before a graph capture, not during"
        _TICKETS[key] = cuda.to_device(np.zeros(shape, np.int32))
    return _TICKETS[key]


@cuda.jit(device=True)
def last_to_arrive(counters, key, n_arrivals):
    """Called by every thread of a (1-D) thread block once its writes are done: makes them
    visible to the whole GPU, takes a ticket from counters[key], and returns 1 in the
    thread block that drew the n_arrivals-th (which also sets the counter back to 0 for
    the next launch or graph replay), 0 in the others."""
    flag = cuda.shared.array(1, int32)
    cuda.threadfence()  # every thread's writes reach the whole GPU before the count does
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        last = cuda.atomic.add(counters, key, 1) == n_arrivals - 1
        flag[0] = 1 if last else 0
        if last:
            counters[key] = 0  # every block has arrived
    cuda.syncthreads()
    return flag[0]


def is_host_numpy(a) -> bool:
    """A NumPy array the GPU cannot read in place (mapped host arrays and device arrays can)."""
    return isinstance(a, np.ndarray) and not hasattr(a, "__cuda_array_interface__")


class DeviceArgs:
    """Use as `with DeviceArgs() as dev:`; `dev.read(a)` / `dev.write(a)` give a's device
    array, and on a clean exit every written NumPy array gets its device bytes back."""

    def __init__(self):
        self._moved = {}  # id(NumPy array) -> [NumPy array, device array, written?]

    def read(self, a):
        return self._move(a, written=False)

    def write(self, a):
        return self._move(a, written=True)

    def _move(self, a, written: bool):
        if not is_host_numpy(a):
            return a
        entry = self._moved.get(id(a))
        if entry is None:
            assert Capture.keep is None, (
                f"a NumPy {a.dtype} array {a.shape} reached a launcher during graph capture; "
                "a captured step reads only device memory")
            entry = self._moved[id(a)] = [a, cuda.to_device(a), False]
        entry[2] |= written
        return entry[1]

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            for host, device, written in self._moved.values():
                if written:
                    device.copy_to_host(host)
        return False


def view_bytes(a, dtype):
    """The same bytes as another dtype (q4_0's `d` fields as float16, say), for any array
    a launcher takes. A mapped host array is wrapped as a device array first: numba-cuda
    0.30's view() of a mapped array fails (it asks for attributes mapped arrays lack)."""
    if isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__"):
        a = cuda.as_cuda_array(a)
    return a.view(dtype)


def grid_for(lanes: int) -> tuple:
    """(blocks, threads, stream) covering `lanes` threads, one lane each."""
    return (lanes + THREADS - 1) // THREADS, THREADS, stream()


def expect(name: str, a, dtype, shape: tuple) -> None:
    """Assert a's dtype, shape (None = any extent) and C layout, naming it in the message."""
    got = a.shape
    ok = a.dtype == dtype and len(got) == len(shape)
    if ok:
        for s, t in zip(shape, got):
            if s is not None and s != t:
                ok = False
    if not ok:  # the message is made only for a failure: launchers call this a few times a launch
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise AssertionError(f"{name} is {tuple(got)} {a.dtype}, want {want} {np.dtype(dtype)}")
    # flags["C_CONTIGUOUS"] is the spelling NumPy, mapped and device arrays all answer
    assert a.flags["C_CONTIGUOUS"], f"{name} must be C-contiguous"


def expect_window(k_new, v_new, positions, page_table) -> tuple[int, int, int]:
    """Check an append's new cells; return (n, n_kv, head_dim)."""
    expect("k_new", k_new, np.float32, (None, None, None))
    n, n_kv, head_dim = k_new.shape
    expect("v_new", v_new, np.float32, (n, n_kv, head_dim))
    expect("positions", positions, np.int32, (n,))
    expect("page_table", page_table, np.int32, (None,))
    return n, n_kv, head_dim


def expect_pool(name: str, a, spec: PoolArray, n_kv: int) -> None:
    """A pool array, indexed by slot: (n_slots, n_kv, BLOCK, per_head)."""
    expect(name, a, spec.dtype, (None, n_kv, BLOCK, spec.per_head))


def host_or_absent(name: str, a, spec: PoolArray, n_kv: int):
    """A host-copy array, indexed by logical block, or a size-0 array meaning "absent".

    Any size-0 array becomes one empty device array of the pool's dtype and rank, so the
    kernel has one signature either way and can test `shape[0] > 0`.
    """
    if a.size == 0:
        return absent((0, n_kv, BLOCK, spec.per_head), spec.dtype)
    expect_pool(name, a, spec, n_kv)
    return a


_ABSENT: dict = {}


def inline_device(fn):
    """@cuda.jit(device=True), inlined into each caller by NVVM (`forceinline`): a loop
    a kernel runs in two places, over different memories, compiles in each as if written
    there. The simulator runs Python and has no such option."""
    if SIMULATED:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def absent(shape, dtype):
    """A size-0 device array, made once per shape and dtype (no copy at launch)."""
    key = (shape, np.dtype(dtype))
    if key not in _ABSENT:
        _ABSENT[key] = cuda.device_array(shape, dtype)
    return _ABSENT[key]
