"""kv_stream_parity on the cuda backend (the simulator in CI, a GPU with STRATA_NB_GPU=1):
the same synthetic decode as tests/test_kv_stream_parity.py, small under the simulator."""
import pytest

from conftest import ON_GPU
from stream_harness import assert_bitwise_equal, check_stream_state, synthetic_decode

SIZE = dict(n_cells=4100, prompt_cells=3840, chunk=256) if ON_GPU else dict(n_cells=120, prompt_cells=64, chunk=32)
STREAMED = dict(kv_resident=128, kv_window=64) if ON_GPU else dict(kv_resident=32 + 64, kv_window=32)


@pytest.fixture(scope="module")
def be():
    from strata_nb.backend.cuda_backend import CudaBackend

    return CudaBackend()


@pytest.mark.parametrize("fmt, qsa_budget", [("fp16", 0), ("int8", 48), ("q4_0", 0), ("k8v4", 48)])
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
