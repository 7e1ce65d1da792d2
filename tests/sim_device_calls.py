"""The CUDA simulator's device-function calls, made cheap (tests only).

What the simulator does. A `@cuda.jit(device=True)` function under numba-cuda's
simulator (numba/cuda/simulator/kernel.py, FakeCUDAKernel.__call__) is called through
`swapped_cuda_module`: for every call, by every simulated thread, it takes a lock, scans
the function's module globals for names bound to `numba.cuda`, rebinds them to the
launch's fake module, calls the function, and on the way out takes the lock again and
puts them back when no other thread still needs them. A call costs about 20 us where a
Python call costs 0.1; the plain tier's kernels call a dequantizer and a warp sum for
every block of a row, so most of an engine test's time under the simulator is spent
here.

What this changes. A device call looks up its module's `cuda` names once (cached per
module), rebinds them to the launch's fake module if they are not already, and calls the
function: no lock, no scan. The modules rebound this way are put back when the launch
ends. This relies on what the simulator already assumes: one launch at a time (its
`_push_kernel_context` asserts it), and no host code of a module running on another
thread while a launch rebinds it (the simulator's own kernel-module swap assumes the
same).

Installed by tests/conftest.py under the simulator, only over the kernel.py it was
written against (sim_barriers.WRITTEN_AGAINST); STRATA_NB_SIM_BARRIERS=plain leaves
the simulator as it is.
"""
from contextlib import contextmanager

from numba import cuda
from numba.cuda.simulator import kernel
from numba.cuda.simulator.kernelapi import FakeCUDAModule

CUDA_NAMES: dict[int, list[str]] = {}  # id(module globals) -> the names bound to numba.cuda
REBOUND: dict[int, tuple[dict, list[str]]] = {}  # the modules this launch's device calls rebound


def cuda_names(globs: dict) -> list[str]:
    names = CUDA_NAMES.get(id(globs))
    if names is None:  # bound to the real module, or to a launch's fake one just now
        names = [k for k, v in globs.items() if v is cuda or isinstance(v, FakeCUDAModule)]
        CUDA_NAMES[id(globs)] = names
    return names


ORIGINAL = {"call": kernel.FakeCUDAKernel.__call__, "push": kernel._push_kernel_context}  # the simulator's own


def install(original=ORIGINAL["call"], push=ORIGINAL["push"]) -> None:
    def call(self, *args):
        launch = kernel._kernel_context
        if not self._device or launch is None:
            return original(self, *args)
        globs = self.fn.__globals__
        names = cuda_names(globs)
        for name in names:
            if globs[name] is not launch:
                globs[name] = launch
                REBOUND[id(globs)] = (globs, names)
        return self.fn(*args)

    @contextmanager
    def push_kernel_context(mod):
        try:
            with push(mod):
                yield
        finally:
            for globs, names in REBOUND.values():
                for name in names:
                    globs[name] = cuda
            REBOUND.clear()

    kernel.FakeCUDAKernel.__call__ = call
    kernel._push_kernel_context = push_kernel_context


def install_casts() -> None:
    """`float32(x)` in a kernel under the simulator is numba's Type.__call__: an ABC
    isinstance check (is x a type, making a signature?) and a lookup of the NumPy scalar
    type by name, for every cast. Plain Python and NumPy numbers go straight to the NumPy
    type; anything else takes numba's own path."""
    import numpy as np
    from numba.core import types

    original = types.Type.__call__
    numbers = {int, float, bool, *(np.dtype(c).type for c in "?bBhHiIlLqQefdg")}
    to_numpy = {}

    def call(self, *args):
        if len(args) == 1 and type(args[0]) in numbers:
            cast = to_numpy.get(self)
            if cast is None:  # Integer and Float cast as getattr(np, self.name)(value)
                plain = isinstance(self, (types.Integer, types.Float)) and hasattr(np, self.name)
                cast = to_numpy[self] = getattr(np, self.name) if plain else self.cast_python_value
            return cast(args[0])
        return original(self, *args)

    types.Type.__call__ = call


def install_arrays() -> None:
    """An array element read or written in a kernel under the simulator goes through two
    wrappers (FakeWithinKernelCUDAArray over FakeCUDAArray over the NumPy array), four
    Python calls; these two do it in one, with the same results (a sub-array comes back
    wrapped twice, a scalar as NumPy's)."""
    import numpy as np
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

    def getitem(self, idx):
        item = self._item
        ret = item._ary[idx]
        if type(ret) is np.ndarray or type(ret) is np.void:
            return FakeWithinKernelCUDAArray(FakeCUDAArray(ret, stream=item.stream))
        return ret

    def setitem(self, idx, val):
        self._item._ary[idx] = val

    FakeWithinKernelCUDAArray.__getitem__ = getitem
    FakeWithinKernelCUDAArray.__setitem__ = setitem
