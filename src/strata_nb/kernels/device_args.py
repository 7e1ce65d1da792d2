"""A launcher's arrays on the device, each moved once.

Launchers accept NumPy arrays or device arrays. Numba would copy a NumPy argument to the
device and back by itself, but one copy per *argument*: an array passed twice (a folded
k8v4 half passes each pool array as both its K and its V field) would become two device
buffers, and a float16 view of a q4_0 byte array (how kernels reach its `d` fields) would
be a third. Each would be copied back over the others. `DeviceArgs` moves each NumPy array
once, so every alias and view in the kernel is the same memory, as on a real GPU.
"""
from __future__ import annotations

import numpy as np
from numba import cuda


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
            assert a.flags.c_contiguous, "launchers take C-contiguous arrays"
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
