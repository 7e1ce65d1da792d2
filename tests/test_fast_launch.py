"""fast/fast_launch.py packs a launch's arguments itself: the same values, of the same
types, that Numba's `_Kernel._prepare_args` packs, and an argument kind that settles
Numba's type of the argument (so a remembered kernel is the one Numba would pick).

Numba's real (not simulated) CUDA target is needed to compare with, and the tests run
under the simulator, so the comparison runs in a child process without
NUMBA_ENABLE_CUDASIM. Device arrays there are made over a fake pointer: packing reads
their shape, strides and address and launches nothing, so no GPU is needed. On a GPU,
STRATA_NB_FAST_LAUNCH=check compares every real launch the same way.
"""
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
    import ctypes
    import numpy as np
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.dispatcher import _Kernel
    from strata_nb.fast import fast_launch as fl

    fl.install()  # its imports (the GPU path's own) work without a GPU

    class FakePointer:  # what a DeviceNDArray asks of its memory
        def __init__(self, address):
            self.device_ctypes_pointer = ctypes.c_void_p(address)

    def device(a, address=0x7F0000001000):
        # a DeviceNDArray shaped as the NumPy array (or view) a: slicing a device array needs a context
        return DeviceNDArray(a.shape, a.strides, a.dtype, gpu_data=FakePointer(address))

    def numba_packs(value):
        ty = fl_typeof(value)
        kernel = _Kernel.__new__(_Kernel)
        kernel.extensions = []
        out = []
        _Kernel._prepare_args(kernel, ty, value, 0, [], out)
        return out

    from numba.cuda.typing.typeof import Purpose, typeof
    def fl_typeof(value):
        return typeof(value, Purpose.argument)

    e = np.empty
    base = e((6, 5, 4), np.float32)
    arrays = {
        "f32 3-D": device(base),
        "f32 1-D": device(e((7,), np.float32)),
        "u8 2-D": device(e((3, 40), np.uint8)),
        "f16 2-D": device(e((3, 8), np.float16)),
        "i32 2-D": device(e((4, 2), np.int32)),
        "row of a 2-D": device(e((3, 40), np.uint8)[1]),
        "columns of a 2-D (strided)": device(e((3, 40), np.uint8)[:, 8:16]),
        "a transposed view (F)": device(e((4, 6), np.float32).T),
        "a reshaped slice": device(base[2:4].reshape(10, 4)),
        "every other row": device(base[::2]),
        "a broadcast row": device(np.broadcast_to(e((1, 4), np.float32), (3, 4))),
        "one row, 2-D": device(e((1, 576), np.float32)),
        "null pointer": device(e((2, 2), np.float32), address=0),
    }
    scalars = {"np.int32": np.int32(-7), "np.uint32": np.uint32(7), "np.int64": np.int64(3), "np.float32":
               np.float32(0.125), "np.float64": np.float64(1.5), "int": 5, "float": 2.5, "bool": True,
               "np.bool_": np.bool_(False), "np.uint8": np.uint8(200), "np.int16": np.int16(-3)}

    failures = []
    kinds = {}  # kind -> Numba type
    for name, a in arrays.items():
        assert type(a) in fl._ARRAY_TYPES, name
        kind, ty = fl._array_kind(a), fl_typeof(a)
        if kinds.setdefault(kind, ty) != ty:
            failures.append(f"{name}: kind {kind} stands for both {kinds[kind]} and {ty}")
        ours = []
        fl._pack_array(a, ours)
        theirs = numba_packs(a)
        if fl._as_comparable(ours) != fl._as_comparable(theirs) or list(map(type, ours)) != list(map(type, theirs)):
            failures.append(f"{name}: packed {fl._as_comparable(ours)}, Numba {fl._as_comparable(theirs)}")
    types_seen = {}
    for ty in kinds.values():
        types_seen.setdefault(ty, 0)
    assert len(types_seen) == len(kinds), "two kinds map to one Numba type: plans would not be shared, but no harm"
    for name, v in scalars.items():
        ours = []
        fl._SCALARS[type(v)](v, ours)
        theirs = numba_packs(v)
        if fl._as_comparable(ours) != fl._as_comparable(theirs) or list(map(type, ours)) != list(map(type, theirs)):
            failures.append(f"{name}: packed {ours}, Numba {theirs}")
    # launch dimensions as Numba takes them: ints, NumPy ints, tuples and lists of either
    for key, want in [((4, 128), (4, 128)), ((np.int64(4), np.int32(128)), (4, 128)),
                      (((2, np.int64(3)), [128]), ((2, 3), (128,))), ((4, 128, 0, 256), (4, 128))]:
        dims = fl._getitem(None, key).dims
        plain = all(type(v) is int for d in dims[:2] for v in (d if isinstance(d, tuple) else (d,)))
        if dims[:2] != want or not plain:
            failures.append(f"launch dimensions {key!r} became {dims!r}")
    print("\n".join(failures) if failures else "ok")
""")


def _child(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_packing_matches_numbas():
    done = _child(CHILD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout


def test_a_wrong_packer_is_caught():
    """The negative control: packing an array's strides before its shape fails the comparison."""
    broken = CHILD.replace("fl.install()", "fl.install()\n"
                           "def _swapped(a, out):\n"
                           "    out += (0, 0, a.size, a.dtype.itemsize, a.gpu_data.device_ctypes_pointer.value)\n"
                           "    out += a.strides\n"
                           "    out += a.shape\n"
                           "fl._pack_array = _swapped")
    done = _child(broken)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() != "ok" and "packed" in done.stdout


DEPENDENT = textwrap.dedent(r"""
    import types
    from strata_nb.fast import fast_launch as fl

    def device(cc):
        return types.SimpleNamespace(compute_capability=cc)

    fl.install()  # a fast backend made earlier in the process has done it already: a no-op then
    installed, fl._INSTALLED = fl._INSTALLED, False
    print("fast path off:", fl.dependent_launch_support(device((9, 0))))
    fl._INSTALLED = installed
    print("sm_80:", fl.dependent_launch_support(device((8, 0))))
    why = fl.dependent_launch_support(device((9, 0)))
    print("sm_90:", repr(why))
    if not why:
        dims = ((4, 1, 1), (256, 1, 1), 0)
        plain, dependent = fl._config(dims, False), fl._config(dims, True)
        print("configs:", plain.programmatic_stream_serialization, dependent.programmatic_stream_serialization,
              fl._config(dims, True) is dependent)
""")


def test_a_dependent_launch_s_config_and_when_there_is_none():
    """fast/dependent_launch.py's launches: the fast path's config for a dependent launch
    asks cuda.core for programmatic stream serialization (and is kept, as a plain one is);
    without the fast path, or on a GPU before sm_90, the support check says why not."""
    done = _child(DEPENDENT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "fast path off: the fast launch path is off" in out
    assert "sm_80: compute capability (8, 0) (dependent launches need 9.0)" in out
    if "sm_90: ''" in out:  # cuda.core >= 1.2 has the option
        assert "configs: False True True" in out
    else:
        assert "has no programmatic_stream_serialization (1.2 has)" in out


PLANS = textwrap.dedent(r"""
    import types
    import numpy as np
    from numba.cuda.typing.typeof import Purpose, typeof
    from strata_nb.fast import fast_launch as fl

    fl.install()

    def dispatcher(**kernel):
        # a stand-in for a CUDADispatcher that has compiled one kernel for an int32 argument
        k = types.SimpleNamespace(debug=False, extensions=[], cooperative=False,
                                  _codelibrary=types.SimpleNamespace(get_cufunc=lambda: types.SimpleNamespace(kernel="f")))
        k.__dict__.update(kernel)
        arg = typeof(np.int32(1), Purpose.argument)
        return types.SimpleNamespace(typeof_pyval=lambda v: typeof(v, Purpose.argument), overloads={(arg,): k})

    for name, kernel in [("plain", {}), ("cooperative", dict(cooperative=True)), ("debug", dict(debug=True))]:
        plan = fl._plan_for(dispatcher(**kernel), (np.int32(1),))
        print(name, "numba" if plan is fl._NUMBA else "fast")
""")


def test_kernels_only_numba_can_launch_stay_with_numba():
    """A kernel that syncs its grid needs Numba's cooperative launch, and a debug kernel
    Numba's error check: the fast path leaves both to Numba (a cooperative kernel launched
    plainly could not sync its grid)."""
    done = _child(PLANS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["plain fast", "cooperative numba", "debug numba"], done.stdout
