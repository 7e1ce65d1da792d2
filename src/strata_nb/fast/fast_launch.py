"""Kernel launches without Numba's per-launch work, on a GPU.

`kernel[grid, block, stream](*args)` in Numba works out every argument's Numba type,
finds the compiled kernel for those types, then turns each argument into the values the
kernel takes (an array is 5 + 2 * ndim of them: meminfo, parent, size, itemsize, data
pointer, shape, strides) through a chain of wrappers. That is tens of microseconds a
launch in Python, and a prompt chunk is about 400 launches: the host, not the GPU, set
the pace of a prefill.

`install()` replaces the dispatcher's `kernel[...]` with `FastLaunch`. Its first launch
for a tuple of argument *kinds* (an array's dtype, ndim and layout; a scalar's type)
goes through Numba as before, and remembers which compiled kernel Numba chose and how
each argument is packed; later launches with the same kinds pack the same values
straight into cuda.core's `launch`. Anything this path does not know (a NumPy host
array Numba would copy, a tuple, a record) always goes through Numba.

`STRATA_NB_FAST_LAUNCH=0` turns it off; `STRATA_NB_FAST_LAUNCH=check` packs every launch
both ways and raises if they differ (the GPU tests run with it). The simulator has no
driver: there every launch is Numba's own.
"""
from __future__ import annotations

import ctypes
import numbers
import os

import numpy as np

from strata_nb.fast.dependent_launch import is_dependent
from strata_nb.gpu.geometry import SIMULATED

MODE = os.environ.get("STRATA_NB_FAST_LAUNCH", "1")
_INSTALLED = False
_DEPENDENT = None  # this GPU and cuda.core take dependent launches: asked at the first one


class FastLaunchMismatch(AssertionError):
    """check mode: this path packed a launch's arguments differently from Numba."""


# ---- an argument's kind, and how it is packed ------------------------------------------
def _array_kind(a):
    """What Numba's type of a device (or mapped) array depends on: dtype, ndim, layout
    (DeviceNDArrayBase._numba_type_: 'C' or 'F' when contiguous and not broadcast)."""
    flags = a.flags  # a dict (device arrays) or NumPy's flags (mapped arrays): both index by name
    if a.size and 0 in a.strides:
        layout = "A"
    elif flags["C_CONTIGUOUS"]:
        layout = "C"
    elif flags["F_CONTIGUOUS"]:
        layout = "F"
    else:
        layout = "A"
    return (a.dtype, a.ndim, layout)


def _pack_array(a, out):
    # DeviceNDArrayBase via _Kernel._prepare_args: meminfo, parent, size, itemsize, data, shape, strides
    out += (0, 0, a.size, a.dtype.itemsize, a.gpu_data.device_ctypes_pointer.value)
    out += a.shape
    out += a.strides


def _scalar_packer(ctype):
    def pack(v, out):
        out.append(ctype(v))
    return pack


def _pack_bool(v, out):
    out.append(v)


# scalar Python/NumPy types -> (kind, packer): what _prepare_args does for Numba's type of each
_SCALARS = {
    int: _scalar_packer(ctypes.c_int64),  # typeof(int) is int64
    float: _scalar_packer(ctypes.c_double),  # typeof(float) is float64
    bool: _pack_bool,
    np.int8: _scalar_packer(ctypes.c_int8), np.uint8: _scalar_packer(ctypes.c_uint8),
    np.int16: _scalar_packer(ctypes.c_int16), np.uint16: _scalar_packer(ctypes.c_uint16),
    np.int32: _scalar_packer(ctypes.c_int32), np.uint32: _scalar_packer(ctypes.c_uint32),
    np.int64: _scalar_packer(ctypes.c_int64), np.uint64: _scalar_packer(ctypes.c_uint64),
    np.float32: _scalar_packer(ctypes.c_float), np.float64: _scalar_packer(ctypes.c_double),
    np.bool_: _pack_bool,
}


def _as_comparable(values):
    """Packed values as plain numbers, to compare this path's packing with Numba's."""
    return [v.value if isinstance(v, ctypes._SimpleCData)
            else v if v is None or isinstance(v, (bool, np.bool_)) else int(v) for v in values]


COUNTS = {"fast": 0, "numba": 0, "dependent": 0}  # launches each way since the process started (fast ones
# launched as dependent: fast/dependent_launch.py)


class _Plan:
    """One (dispatcher, argument kinds): the compiled kernel's function and each argument's packer."""

    __slots__ = ("function", "packers")

    def __init__(self, function, packers):
        self.function, self.packers = function, packers


# --8<-- [start:fast_launch]
class FastLaunch:
    """What `kernel[grid, block, stream, shared]` returns once install() ran."""

    __slots__ = ("dispatcher", "dims", "stream")

    def __init__(self, dispatcher, dims, stream):
        self.dispatcher, self.dims, self.stream = dispatcher, dims, stream

    def __call__(self, *args):
        d = self.dispatcher
        kinds = []
        for a in args:
            t = type(a)
            if t in _ARRAY_TYPES:
                kinds.append(_array_kind(a))
            elif t in _SCALARS:
                kinds.append(t)
            else:
                return _numba_launch(d, self.dims, self.stream, args)  # not this path's: Numba's
        kinds = tuple(kinds)
        plans = d.__dict__.get("_strata_plans")
        if plans is None:
            plans = d._strata_plans = {}
        plan = plans.get(kinds)
        if plan is None:
            _numba_launch(d, self.dims, self.stream, args)  # compiles if need be, and launches
            plans[kinds] = _plan_for(d, args)
            return None
        if plan is _NUMBA:
            return _numba_launch(d, self.dims, self.stream, args)
        packed = []
        for pack, a in zip(plan.packers, args):
            pack(a, packed)
        dependent = is_dependent(d) and _dependent_here()
        config, stream = _config(self.dims, dependent), _core_stream(self.stream)
        if MODE == "check":
            _check(d, args, packed)
        _launch(stream, config, plan.function, *packed)
        COUNTS["fast"] += 1
        COUNTS["dependent"] += dependent
        return None


# --8<-- [end:fast_launch]


def _numba_launch(dispatcher, dims, stream, args):
    COUNTS["numba"] += 1
    grid, block, shared = dims
    return _ORIGINAL_CONFIGURE(dispatcher, grid, block, stream, shared)(*args)


def _plan_for(dispatcher, args):
    """After Numba launched once with these arguments: the kernel it chose, and a packer per
    argument (None where this path cannot pack it: then the plan is never used)."""
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    kernel = dispatcher.overloads.get(argtypes)
    # a cooperative kernel (one that syncs its grid) needs Numba's cooperative launch
    if (kernel is None or kernel.debug or kernel.extensions or kernel.cooperative
            or getattr(kernel, "launch_config_sensitive", False)):
        return _NUMBA
    packers = tuple(_pack_array if type(a) in _ARRAY_TYPES else _SCALARS[type(a)] for a in args)
    return _Plan(kernel._codelibrary.get_cufunc().kernel, packers)


class _NumbaOnly:
    """A plan that says: always through Numba."""
    packers = ()


_NUMBA = _NumbaOnly()

_CONFIGS: dict = {}
_STREAMS: dict = {}


def _config(dims, dependent: bool = False):
    """The launch config for (grid, block, shared), as a dependent launch or a plain one."""
    c = _CONFIGS.get((dims, dependent))
    if c is None:
        grid, block, shared = dims
        grid, block = _NORMALIZE(grid, block)
        extra = {"programmatic_stream_serialization": True} if dependent else {}
        c = _CONFIGS[dims, dependent] = _LaunchConfig(grid=grid, block=block, shmem_size=shared, **extra)
    return c


def _dependent_here() -> bool:
    global _DEPENDENT
    if _DEPENDENT is None:
        _DEPENDENT = dependent_launch_support() == ""
    return _DEPENDENT


def dependent_launch_support(device=None) -> str:
    """'' when marked kernels can launch as dependent here (fast/dependent_launch.py), else
    why not: the GPU's compute capability, this cuda.core's LaunchConfig, or the fast path."""
    if not _INSTALLED:
        return "the fast launch path is off (STRATA_NB_FAST_LAUNCH=0, or no GPU)"
    if device is None:
        from numba import cuda
        device = cuda.get_current_device()
    if tuple(device.compute_capability) < (9, 0):
        return f"compute capability {device.compute_capability} (dependent launches need 9.0)"
    try:
        _LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except TypeError:
        import cuda.core
        return f"cuda.core {cuda.core.__version__} has no programmatic_stream_serialization (1.2 has)"
    return ""


def _core_stream(stream):
    if not stream:
        s = _STREAMS.get(0)
        if s is None:
            s = _STREAMS[0] = _TO_CORE_STREAM(0)
        return s
    return _TO_CORE_STREAM(stream)


def _check(dispatcher, args, packed):
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    kernel = dispatcher.overloads[argtypes]
    theirs, retr = [], []
    for t, v in zip(kernel.argument_types, args):
        kernel._prepare_args(t, v, 0, retr, theirs)
    if _as_comparable(theirs) != _as_comparable(packed) or [type(v) for v in theirs] != [type(v) for v in packed]:
        raise FastLaunchMismatch(f"{dispatcher.__name__}: packed {_as_comparable(packed)} where Numba packs "
                                 f"{_as_comparable(theirs)}")


def _getitem(self, key):
    if not isinstance(key, tuple) or len(key) not in (2, 3, 4):
        raise ValueError("must specify at least the griddim and blockdim")
    grid, block = key[0], key[1]
    stream = key[2] if len(key) > 2 else 0
    shared = key[3] if len(key) > 3 else 0
    # a dimension is an integer (NumPy's too, as Numba takes it) or a sequence of them
    return FastLaunch(self, (int(grid) if isinstance(grid, numbers.Integral) else tuple(map(int, grid)),
                             int(block) if isinstance(block, numbers.Integral) else tuple(map(int, block)), shared),
                      stream)


def install():
    """Route every `kernel[...]` launch through FastLaunch (a GPU only; once)."""
    global _INSTALLED, _ARRAY_TYPES, _ORIGINAL_CONFIGURE, _LaunchConfig, _NORMALIZE, _TO_CORE_STREAM, _launch
    if _INSTALLED or SIMULATED or MODE == "0":
        return
    from cuda.core import LaunchConfig, launch
    from numba.cuda.cudadrv.devicearray import DeviceNDArray, MappedNDArray
    from numba.cuda.cudadrv.driver import _to_core_stream
    from numba.cuda.dispatcher import CUDADispatcher, normalize_kernel_dimensions

    _ARRAY_TYPES = frozenset((DeviceNDArray, MappedNDArray))
    _ORIGINAL_CONFIGURE = CUDADispatcher.configure
    _LaunchConfig, _NORMALIZE, _TO_CORE_STREAM, _launch = LaunchConfig, normalize_kernel_dimensions, _to_core_stream, launch
    CUDADispatcher.__getitem__ = _getitem
    _INSTALLED = True


_ARRAY_TYPES: frozenset = frozenset()
_ORIGINAL_CONFIGURE = _LaunchConfig = _NORMALIZE = _TO_CORE_STREAM = _launch = None
