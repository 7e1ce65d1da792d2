"""The warm-up launches every kernel a run launches (engine/engine.py: Engine.run_scratch),
with the same signatures: Numba makes a kernel per signature on its first launch, so a
kernel the warm-up missed would be compiled, or loaded from the kernel cache, inside the
run's prefill or decode, and --stats would count that time there.

Under the simulator a run launches its kernels one by one; on a GPU the decode step is a
graph of the same launches (fast/cuda_graph.py), which is why the scratch engine launches
one eager step and captures nothing, and the launches are noted where `kernel[...]` is
made (launched_on_the_gpu). The control: a warm-up without its
decode step misses the step's own kernels."""
import pytest
from conftest import ON_GPU

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.engine.engine import Engine
from strata_nb.fast.sm90 import record_launches, variant
from strata_nb.kernels.dense.matvec import MAX_ROWS
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import SamplingSettings, Settings

pytestmark = pytest.mark.sim_engine  # a prompt chunk and decode steps under the simulator: a minute on a CPU

PROMPT = [3 + ord(c) for c in "a prompt, 12"]  # more rows than a window has: the prompt kernels


def launched(action) -> set:
    """The (kernel, signature) pairs `action()` launches."""
    if ON_GPU:
        return launched_on_the_gpu(action)
    from numba.cuda.simulator import kernel as sim

    found: dict = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sim.FakeCUDAKernel, "__call__", sim.FakeCUDAKernel.__call__)  # put back afterwards
        record_launches(found)
        action()
    return {(kernel, sig) for kernel, sigs in found.items() for sig in sigs}


def launched_on_the_gpu(action) -> set:
    """The same pairs on a GPU: every `kernel[...]` (Numba's launch or the fast tier's,
    fast/fast_launch.py) is wrapped to note the kernel and its arguments' Numba types.
    A graph's replay launches nothing from Python; its capture did."""
    from numba import typeof
    from numba.cuda.dispatcher import CUDADispatcher

    found, configure = set(), CUDADispatcher.__getitem__

    def noting(dispatcher, key):
        launch = configure(dispatcher, key)
        fn = dispatcher.py_func

        def call(*args):
            if fn.__module__.startswith("strata_nb."):
                found.add(((fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno, variant(fn)),
                           f"void({', '.join(str(typeof(a)) for a in args)})"))
            return launch(*args)
        return call

    with pytest.MonkeyPatch.context() as m:
        m.setattr(CUDADispatcher, "__getitem__", noting)
        action()
    return found


@pytest.fixture(scope="module")
def engine(tiny_model):
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cuda")
    return Engine(settings, GGUFModel(tiny_model), FastCudaBackend())


@pytest.fixture(scope="module")
def run(engine):
    """What a run of the prompt launches: its prefill and three decode steps."""
    return launched(lambda: "".join(engine.generate_ids(PROMPT, SamplingSettings(max_tokens=4))))


def test_the_warm_up_launches_every_kernel_a_run_launches(engine, run):
    assert len(PROMPT) > MAX_ROWS + 2
    warm = launched(lambda: engine.run_scratch(PROMPT))
    assert run and run <= warm, sorted(run - warm)


def test_a_warm_up_without_its_decode_step_misses_kernels(engine, run, monkeypatch):
    """The negative control: with the scratch engine's decode step left out, the run
    launches kernels the warm-up did not: the step's advance among them."""
    monkeypatch.setattr(Engine, "tokens_after", lambda *args: iter(()))
    warm = launched(lambda: engine.run_scratch(PROMPT))
    assert "advance_step_kernel" in {kernel[1] for kernel, _ in run - warm}
