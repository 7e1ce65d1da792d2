"""Test setup. Numba picks the CUDA simulator or a real GPU when it is first imported,
so the choice is made here, before any test module imports numba.

STRATA_NB_GPU=1 runs the same kernel tests on a real GPU (larger shapes); otherwise the
simulator runs them on the CPU with small shapes.
"""
import os
import sys

ON_GPU = os.environ.get("STRATA_NB_GPU") == "1"
if not ON_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # The simulator runs each CUDA thread as a Python thread; switching often makes it
    # about 7x faster on small grids.
    sys.setswitchinterval(1e-4)

import pytest  # noqa: E402


def _thread_safe_shared_arrays():
    """numba-cuda 0.30's simulator makes a block's shared array on the first call at a
    source line, with a check-then-insert that is not atomic: two simulated threads can
    each see none and keep their own array, so one thread's writes never reach the
    others (seen as a top-p draw that changed from run to run). The same lookup, under a
    lock."""
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    lock, original = threading.Lock(), kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe())[-2][0:2])  # (file, line) of the kernel's call
        with lock:
            if caller not in self._allocations:
                self._allocations[caller] = np.empty(shape, dtype)
            return self._allocations[caller]

    kernelapi.FakeCUDAShared.array = array


if not ON_GPU:
    _thread_safe_shared_arrays()


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF, fetched into the cache (STRATA_NB_HOME) on first use."""
    from strata_nb.model.fetch import ensure_default_model

    return str(ensure_default_model(progress=False))


_engines: dict = {}


@pytest.fixture(scope="session")
def engine_for(default_model_path):
    """engine_for(kv="fp16", **settings) -> a cached Engine on the numpy backend."""
    from strata_nb import Engine

    def make(kv="fp16", **kw):
        key = (kv, tuple(sorted(kw.items())))
        if key not in _engines:
            _engines[key] = Engine.load(model=default_model_path, kv=kv, device="cpu", **kw)
        return _engines[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random-weight llama GGUF (byte-level vocab): fast CLI and error tests."""
    from strata_nb.model.synthetic import write_synthetic_gguf

    return str(write_synthetic_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


# ---- PTX for sm_90: every kernel the simulator ran, compiled for the GPU ----------------
# The simulator runs kernels as Python, so it accepts code the GPU compiler rejects. Each
# simulated launch records its kernel and argument types here; tests/test_zz_ptx_sm90.py
# (collected last) compiles each one to sm_90 PTX in a process without the simulator.
LAUNCHES: dict = {}


def _type_name(a) -> str:
    import numpy as np

    a = getattr(a, "_ary", a)  # a simulator device array wraps a NumPy array
    if isinstance(a, np.ndarray):
        dims = [":"] * a.ndim
        if a.flags.c_contiguous and a.ndim:
            dims[-1] = "::1"
        return f"{a.dtype.name}[{', '.join(dims)}]"
    if isinstance(a, (bool, np.bool_)):
        return "boolean"
    if isinstance(a, np.generic):
        return a.dtype.name
    return {int: "int64", float: "float64"}[type(a)]


def _record_launches():
    from numba.cuda.simulator import kernel as sim

    call = sim.FakeCUDAKernel.__call__

    def recording_call(self, *args):
        fn = self.fn
        # the product's kernels only: importing a test module in the checking process would
        # import this conftest, whose simulator hooks would then replace later kernels
        if not self._device and not sim._kernel_context and fn.__module__.startswith("strata_nb."):
            key = (fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno)
            try:
                LAUNCHES.setdefault(key, set()).add(f"void({', '.join(_type_name(a) for a in args)})")
            except KeyError:
                pass  # an argument type we do not map: that launch is not checked
        return call(self, *args)

    sim.FakeCUDAKernel.__call__ = recording_call


if not ON_GPU:
    _record_launches()
