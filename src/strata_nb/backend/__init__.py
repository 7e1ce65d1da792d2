"""Backends: where arrays live and which implementation of each op runs.

`numpy`: the references on the CPU. `cuda`: the @cuda.jit kernels (and, with
NUMBA_ENABLE_CUDASIM=1, the same kernels under Numba's simulator).
"""
from __future__ import annotations

from ..errors import StrataError


def get_backend(device: str):
    if device in ("auto", "cpu"):
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    raise StrataError(f"--device {device} is not built yet; use --device cpu")
