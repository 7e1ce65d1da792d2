"""Test setup. Numba picks the CUDA simulator or a real GPU when it is first imported,
so the choice is made here, before any test module imports numba.

STRATA_NB_GPU=1 runs the same kernel tests on a real GPU (larger shapes); otherwise the
simulator runs them on the CPU with small shapes.

Two tiers. `python -m pytest -q` runs the default tier, minutes on two CPU cores; it
leaves out the tests marked `sim_engine` (the whole engine under the simulator, where every
CUDA thread is a Python thread: minutes each on a CPU, seconds on a GPU), `fast_twin` (a
fast-tier kernel against its plain twin: the default tier holds every plain kernel to its
reference, and the engine's one writer, streamed against resident, in every format) and
`slow`.
STRATA_NB_TESTS=all runs every test, as CI does (.ci/run); STRATA_NB_GPU=1 runs the
`sim_engine` and `fast_twin` tests too. A test file or test named on the command line always runs.
"""
import os
import sys
from pathlib import Path

if "PYTEST_XDIST_WORKER" in os.environ:
    # A process per core (pytest-xdist): NumPy's BLAS threads would make every worker's
    # matrix products fight for the same cores (its threads spin while they wait). One each.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

ON_GPU = os.environ.get("STRATA_NB_GPU") == "1"
ALL_TIERS = os.environ.get("STRATA_NB_TESTS") == "all"
if ON_GPU:
    # every launch packed both ways, fast/fast_launch.py's and Numba's, and compared
    os.environ.setdefault("STRATA_NB_FAST_LAUNCH", "check")
if not ON_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # The simulator runs each CUDA thread as a Python thread; switching often makes it
    # about 7x faster on small grids.
    sys.setswitchinterval(1e-4)
    # Its barriers wake the waiting threads instead of polling them (tests/sim_barriers.py).
    import sim_barriers
    import sim_device_calls

    if sim_barriers.install():  # the simulator these were written against
        sim_device_calls.install()
        sim_device_calls.install_casts()
        sim_device_calls.install_arrays()

import pytest  # noqa: E402


def _thread_safe_shared_arrays():
    """numba-cuda 0.30's simulator makes a block's shared array on the first call at a
    source line, with a check-then-insert that is not atomic: two simulated threads can
    each see none and keep their own array, so one thread's writes never reach the
    others (seen as a top-p draw that changed from run to run). The same lookup, under a
    lock, and an array for each thread block: the simulator's one per line serves every
    block of a launch, which is right only while they run one after another (the
    megakernel's test runs them at once, sim_barriers.concurrent_blocks)."""
    import threading

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
        frame = sys._getframe(1)  # the kernel's line that asks (the simulator's own lookup
        block = getattr(threading.current_thread(), "blockIdx", None)  # reads every frame's source for these two)
        caller = (frame.f_code.co_filename, frame.f_lineno, None if block is None else tuple(block))
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


@pytest.fixture(scope="session")
def k_quant_model(tmp_path_factory):
    """A 1-layer random model with every matrix Q4_K (d 256: rows of whole super-blocks)."""
    from strata_nb.model.synthetic import write_synthetic_gguf

    return str(write_synthetic_gguf(tmp_path_factory.mktemp("k_quant") / "q4_k.gguf", n_layers=1, d_model=256,
                                    d_ff=256, n_heads=4, n_kv_heads=2, head_dim=64, qtype="Q4_K"))


# ---- the default tier, and the test that runs last ----------------------------------------
LEFT_OUT = pytest.StashKey[int]()  # how many tests the default tier left out of this run


def left_out(item, named: set[Path]) -> bool:
    """Whether the default tier leaves this test out (see the module docstring)."""
    if ALL_TIERS or item.path.resolve() in named:
        return False
    return item.get_closest_marker("slow") is not None or not ON_GPU and (
        item.get_closest_marker("sim_engine") is not None or item.get_closest_marker("fast_twin") is not None)


def pytest_collection_modifyitems(config, items):
    if not config.option.markexpr:  # a -m expression picks the tests itself
        named = {(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args}
        out = [item for item in items if left_out(item, named)]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [item for item in items if item not in out]
            config.stash[LEFT_OUT] = len(out)
    # Under pytest-xdist a file's tests go to one worker, files in the order collected
    # (--no-loadscope-reorder): the files that take longest first, so no worker is left
    # running a long one while the other has nothing to do; `last` tests after every other
    # (the PTX check compiles each kernel the session ran).
    cost = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0) + guessed_seconds(item)
    items.sort(key=lambda item: (item.get_closest_marker("last") is not None, -cost[item.path]))  # stable


def guessed_seconds(item) -> int:
    """A test's time under the simulator, roughly, from its marks: only the order matters."""
    if item.get_closest_marker("sim_engine") or item.get_closest_marker("slow"):
        return 60
    if item.get_closest_marker("fast_twin"):
        return 8
    return 5 if item.get_closest_marker("model") else 1  # the default model on the numpy backend


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, in the controller: each worker collected and left out the same tests."""
    node.config.stash[LEFT_OUT] = node.workeroutput.get("left_out", 0)


def pytest_terminal_summary(terminalreporter):
    n = terminalreporter.config.stash.get(LEFT_OUT, 0)
    if n:
        terminalreporter.write_line(f"default tier: {n} tests marked slow, sim_engine or fast_twin left out; "
                                    "STRATA_NB_TESTS=all python -m pytest -q runs every test (as CI does)")


# ---- PTX for sm_90: every kernel the simulator ran, compiled for the GPU ----------------
# The simulator runs kernels as Python, so it accepts code the GPU compiler rejects. Each
# simulated launch records its kernel and argument types here; tests/test_ptx_sm90.py (marked
# `last`, so run after every other test) compiles each one to sm_90 PTX in a
# process without the simulator (fast/sm90.py).
LAUNCHES: dict = {}

if not ON_GPU:
    from strata_nb.fast.sm90 import record_launches

    record_launches(LAUNCHES)

# Under pytest-xdist (pyproject.toml runs the tests in a process per core) each worker
# records its own launches. A worker leaves them in a folder the run's workers share,
# <worker>.json, after every test that added one, and <worker>.done when it has no test
# left; the sm_90 check compiles what the others have left so far while it waits for
# every other worker's .done, then the rest (launches_so_far). Its file runs on one
# worker, after the rest (`--dist loadfile`, and the file is marked `last`); a worker
# waiting in it says <worker>.waiting, which counts as done, so two workers that each got
# a share of it cannot wait for each other.
SHARED: dict = {}  # "folder": the run's shared folder, "worker": this worker's id, "written": pairs last written


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and not ON_GPU:
        import tempfile

        folder = Path(tempfile.gettempdir()) / f"strata-nb-launches-{workerinput['testrunuid']}"
        folder.mkdir(exist_ok=True)
        SHARED.update(folder=folder, worker=workerinput["workerid"], written=0)


def leave_launches(mark: str | None = None) -> None:
    """Write this worker's launches to the shared folder if they grew; then the mark."""
    import json

    folder, worker = SHARED["folder"], SHARED["worker"]
    pairs = sum(len(sigs) for sigs in LAUNCHES.values())
    if pairs != SHARED["written"]:
        part = folder / f"{worker}.json.part"
        part.write_text(json.dumps([[list(key), sorted(sigs)] for key, sigs in LAUNCHES.items()]))
        part.replace(folder / f"{worker}.json")
        SHARED["written"] = pairs
    if mark:
        (folder / f"{worker}.{mark}").touch()


def pytest_runtest_logreport(report):
    if SHARED and report.when == "teardown":
        leave_launches()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["left_out"] = session.config.stash.get(LEFT_OUT, 0)
    if SHARED:
        leave_launches("done")


def launches_so_far(timeout_s: float = 3600):
    """Yield (launches, final): this worker's LAUNCHES merged with every other worker's as
    they stand, again and again while the others still run tests (the sm_90 check compiles
    each batch meanwhile, so its worker does not sit idle), and last with final=True once
    they have all run theirs."""
    if not SHARED:
        yield LAUNCHES, True
        return
    import json
    import time

    leave_launches("waiting")
    folder, workers = SHARED["folder"], int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    others = [f"gw{i}" for i in range(workers) if f"gw{i}" != SHARED["worker"]]
    deadline = time.monotonic() + timeout_s
    while True:
        final = all((folder / f"{w}.done").exists() or (folder / f"{w}.waiting").exists() for w in others)
        merged = {key: set(sigs) for key, sigs in LAUNCHES.items()}
        for w in others:
            if (folder / f"{w}.json").exists():
                for key, sigs in json.loads((folder / f"{w}.json").read_text()):
                    merged.setdefault(tuple(key), set()).update(sigs)
        yield merged, final
        if final:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the sm_90 check waited {timeout_s:.0f} s for the other workers' launches ({folder})")
        time.sleep(1)
