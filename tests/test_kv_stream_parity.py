"""kv_stream_parity: streamed attention equals fully resident attention, bit for bit.

A synthetic decode (a prompt in chunks of 256, then steps and verify windows of 1..8 with
rejected tails rewritten), every format, dense selection and QSA selection, with the
resident size at its minimum so the CLOCK pool evicts constantly. The default tier runs
700 cells and the negative control; the slow tier 4,100 cells (a 3,840-cell prompt), on
the numpy backend. tests/kernels/test_kv_stream_parity_sim.py runs the same body small
on the cuda backend under the simulator.
"""
import numpy as np
import pytest

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kv_layout import FORMATS
from stream_harness import assert_bitwise_equal, check_stream_state, synthetic_decode

BE = NumpyBackend()
SMALL = dict(n_cells=700, prompt_cells=512, chunk=256)
FULL = dict(n_cells=4100, prompt_cells=3840, chunk=256)  # minutes per format and budget on a CPU
STREAMED = dict(kv_resident=64 + 64, kv_window=64)  # the minimum: ring of 4 blocks + 4 pool slots


def check_parity(fmt, qsa_budget, size):
    resident, _ = synthetic_decode(BE, fmt, kv_window=64, qsa_budget=qsa_budget, **size)
    streamed, cache = synthetic_decode(BE, fmt, qsa_budget=qsa_budget, check=check_stream_state(BE),
                                       **STREAMED, **size)
    assert_bitwise_equal(resident, streamed)
    c = cache.counters
    assert c.misses > 0 and c.copies > 0 and c.in_place > 0  # eviction really happened
    assert c.staged_blocks > 0


@pytest.mark.parametrize("qsa_budget", [0, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_equals_resident(fmt, qsa_budget):
    check_parity(fmt, qsa_budget, SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("qsa_budget", [0, 512])
@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_equals_resident_over_4100_cells(fmt, qsa_budget):
    check_parity(fmt, qsa_budget, FULL)


def test_fault_drop_v_mirror_breaks_parity():
    """Negative control: the unfolded V half skips the host copy and the parity test fails."""
    size = dict(n_cells=700, prompt_cells=512, chunk=256)
    resident, _ = synthetic_decode(BE, "k8v4", kv_window=64, **size)
    streamed, cache = synthetic_decode(BE, "k8v4", fault="drop-v-mirror", **STREAMED, **size)
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(resident, streamed)
    assert not cache.layers[0].host["v_q4"][:40].any()  # the host copy never got a V byte
