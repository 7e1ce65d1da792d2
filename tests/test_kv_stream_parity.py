"""kv_stream_parity: streamed attention equals fully resident attention, bit for bit.

A synthetic decode of 4,100 cells (a 3,840-cell prompt in chunks of 256, then steps and
verify windows of 1..8 with rejected tails rewritten), every format, dense selection and
QSA selection, with the resident size at its minimum so the CLOCK pool evicts constantly.
Full size on the numpy backend; tests/kernels/test_kv_stream_parity_sim.py runs the same
body small on the cuda backend under the simulator.
"""
import numpy as np
import pytest

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kv_layout import FORMATS
from stream_harness import assert_bitwise_equal, check_stream_state, synthetic_decode

pytestmark = pytest.mark.slow  # 4,100 cells per format and budget on the CPU: minutes

BE = NumpyBackend()
SIZE = dict(n_cells=4100, prompt_cells=3840, chunk=256)
STREAMED = dict(kv_resident=64 + 64, kv_window=64)  # the minimum: ring of 4 blocks + 4 pool slots


@pytest.mark.parametrize("qsa_budget", [0, 512])
@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_equals_resident(fmt, qsa_budget):
    resident, _ = synthetic_decode(BE, fmt, kv_window=64, qsa_budget=qsa_budget, **SIZE)
    streamed, cache = synthetic_decode(BE, fmt, qsa_budget=qsa_budget, check=check_stream_state(BE),
                                       **STREAMED, **SIZE)
    assert_bitwise_equal(resident, streamed)
    c = cache.counters
    assert c.misses > 0 and c.copies > 0 and c.in_place > 0  # eviction really happened
    assert c.staged_blocks > 0


def test_fault_drop_v_mirror_breaks_parity():
    """Negative control: the unfolded V half skips the host copy and the parity test fails."""
    size = dict(n_cells=700, prompt_cells=512, chunk=256)
    resident, _ = synthetic_decode(BE, "k8v4", kv_window=64, **size)
    streamed, cache = synthetic_decode(BE, "k8v4", fault="drop-v-mirror", **STREAMED, **size)
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(resident, streamed)
    assert not cache.layers[0].host["v_q4"][:40].any()  # the host copy never got a V byte
