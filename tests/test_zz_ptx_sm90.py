"""Every kernel the simulator ran in this session compiles to PTX for sm_90 (Hopper).

The simulator executes kernels as Python, so it accepts things the GPU compiler rejects
(a NumPy call inside a kernel, a type that does not unify). This test is collected last:
conftest.py recorded each simulated launch's kernel and argument types, and a child process
without the simulator compiles each with `cuda.compile_ptx(..., cc=(9, 0))`. No GPU needed,
only NVRTC/libNVVM (the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 wheels)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import LAUNCHES, ON_GPU

CHILD = textwrap.dedent('''
    import importlib, json, sys, types
    from numba import cuda
    import numba.cuda.dispatcher
    from numba.cuda.dispatcher import CUDADispatcher
    # compiling a kernel that calls device functions asks for the current device; there is
    # none here, so answer for the target we compile for
    numba.cuda.dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    todo = json.load(sys.stdin)
    def dispatchers(obj, depth=0):
        if isinstance(obj, CUDADispatcher):
            yield obj
        elif isinstance(obj, dict) and depth < 3:
            for v in obj.values():
                yield from dispatchers(v, depth + 1)
    failures = []
    for module, qualname, line, sigs in todo:
        mod = importlib.import_module(module)
        found = [d for v in vars(mod).values() for d in dispatchers(v)
                 if d.py_func.__qualname__ == qualname and d.py_func.__code__.co_firstlineno == line]
        if not found:
            failures.append(f"{module}.{qualname} (line {line}): kernel not found at import")
            continue
        for sig in sigs:
            errors = []
            for d in found:  # kernels built by a factory share a name: one must accept the signature
                try:
                    cuda.compile_ptx(d.py_func, sig, cc=(9, 0))
                    break
                except Exception as err:
                    errors.append(f"{type(err).__name__}: {str(err)[:300]}")
            else:
                failures.append(f"{module}.{qualname}{sig}: " + " | ".join(errors))
    print(json.dumps(failures))
''')


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled for real")
def test_every_simulated_kernel_compiles_for_sm90():
    if not LAUNCHES:
        pytest.skip("no kernel ran under the simulator in this session (run the whole suite)")
    try:
        import nvidia.cuda_nvrtc  # noqa: F401  (the wheel that carries NVRTC)
    except ImportError:
        pytest.fail("NVRTC is missing: pip install -e '.[dev]' brings nvidia-cuda-nvrtc-cu12")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    todo = [[m, q, line, sorted(sigs)] for (m, q, line), sigs in LAUNCHES.items()]
    run = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(todo), capture_output=True,
                         text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    failures = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
