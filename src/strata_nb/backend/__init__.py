"""Backends: where arrays live and which implementation of each op runs.

`numpy`: the references on the CPU. `cuda`: the @cuda.jit kernels (and, with
NUMBA_ENABLE_CUDASIM=1, the same kernels under Numba's simulator), in one of two tiers
(`--kernels`): `plain`, one plain kernel per op (cuda_backend.py), `fast`, the fast
tier's fused kernels and launches (fast/backend.py, the default), or `mega`, the fast
tier with each decode step one launch of a persistent kernel (fast/mega/).

`--device cpu` is numpy, `--device cuda` is cuda (a GPU, or the simulator when it is
switched on), and `--device auto` is cuda only on a real GPU: the simulator is for tests,
far too slow to choose by default.
"""
from __future__ import annotations

from ..errors import SettingError


def gpu_present() -> bool:
    """A real CUDA GPU with a working driver (never the simulator)."""
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


FAST_TIERS = ("fast", "mega")  # the backends of the fast tier: device steps, graphs, fused launches


def get_backend(device: str, kernels: str = "fast"):
    from numba import config, cuda

    if device == "cuda" and not (config.ENABLE_CUDASIM or cuda.is_available()):
        raise SettingError("device", "is cuda, which needs an NVIDIA GPU with a working driver, and none was found; "
                                     "use cpu (or NUMBA_ENABLE_CUDASIM=1 to simulate one)")
    if device == "cuda" or (device == "auto" and gpu_present()):
        if kernels == "plain":
            from .cuda_backend import CudaBackend

            return CudaBackend()
        if kernels == "mega":
            from ..fast.mega.step import MegaBackend

            return MegaBackend()
        from ..fast.backend import FastCudaBackend

        return FastCudaBackend()
    if device in ("auto", "cpu"):
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    raise SettingError("device", f"{device!r} is not one of auto, cpu, cuda")
