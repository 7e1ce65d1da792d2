"""kv_stream_parity on the cuda backend (the simulator in CI, a GPU with STRATA_NB_GPU=1):
the same synthetic decode as tests/test_kv_stream_parity.py, small under the simulator."""
import pytest

from conftest import ON_GPU
from stream_harness import assert_bitwise_equal, check_stream_state, synthetic_decode

pytestmark = pytest.mark.sim_engine  # a streamed decode on the cuda backend under the simulator: minutes on a CPU

# Under the simulator every CUDA thread is a Python thread: 2 query heads sharing 1 KV head
# and ~100 cells keep a run to seconds. On a GPU: the numpy test's full size and heads.
SIZE = (dict(n_cells=4100, prompt_cells=3840, chunk=256) if ON_GPU else
        dict(n_cells=88, prompt_cells=16, chunk=16, n_heads=2, n_kv=1))
STREAMED = dict(kv_resident=128, kv_window=64) if ON_GPU else dict(kv_resident=16 + 64, kv_window=16)


@pytest.fixture(scope="module")
def be():
    from strata_nb.fast.backend import FastCudaBackend

    return FastCudaBackend()


@pytest.mark.parametrize("fmt, qsa_budget", [("k8v4", 48)] if not ON_GPU else
                         [(f, b) for f in ("fp32", "fp16", "int8", "q4_0", "k8v4") for b in (0, 512)])
def test_streamed_equals_resident_on_cuda_backend(be, fmt, qsa_budget):
    resident, _ = synthetic_decode(be, fmt, kv_window=STREAMED["kv_window"], qsa_budget=qsa_budget, **SIZE)
    streamed, cache = synthetic_decode(be, fmt, qsa_budget=qsa_budget, check=check_stream_state(be),
                                       **STREAMED, **SIZE)
    assert_bitwise_equal(resident, streamed)
    assert cache.counters.misses > 0


def test_fault_breaks_parity_on_cuda_backend(be):
    resident, _ = synthetic_decode(be, "k8v4", kv_window=STREAMED["kv_window"], **SIZE)
    streamed, _ = synthetic_decode(be, "k8v4", fault="drop-v-mirror", **STREAMED, **SIZE)
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(resident, streamed)
