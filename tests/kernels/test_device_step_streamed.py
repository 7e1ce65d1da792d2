"""A streamed cache's decode step on the device (kv/cache.py: StepBlocks, map_ring,
select_blocks) against the host path, on the cuda backend: QSA, two steps that cross into
a new block (the ring moves on), then a step on the host path again. (Dense streaming
takes the same route with every block up to the query selected: test_step_selection.py
checks that choice.)

The host path resolves misses into slots by CLOCK and copies them; the device step reads
them in place from the host copy. The bytes are the same, so the logits must be equal bit
for bit. Afterwards the host's maps must be the device's, and the device's lookups must
be in the counters: the host path's next decisions start from them.

The tiny model (2 layers, 1 KV head) with a ring of 1 block and a pool of 4, 15 prompt
tokens in block 0, prefilled once and restored into the second engine: under the
simulator each forward pass takes seconds. A negative control drops the V half's host
writes (--fault drop-v-mirror) and must change the replayed step's logits.
"""
import numpy as np
import pytest

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.engine.engine import Engine
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import Settings

pytestmark = pytest.mark.sim_engine  # the streamed decode step end to end under the simulator: minutes on a CPU

PROMPT = [3 + (7 * i) % 90 for i in range(15)]  # positions 0..14: block 0
STEPS = (15, 16)  # 16 enters block 1: the ring leaves block 0, which is then read in place
AFTER = 17  # a host-path step after the replayed ones


def engine(tiny_model, fault="none"):
    settings = Settings(model=tiny_model, kv="k8v4", max_context=128, kv_window=16, kv_resident=80,
                        qsa_budget=48, fault=fault, device="cuda")
    return Engine(settings, GGUFModel(tiny_model), FastCudaBackend())


@pytest.fixture(scope="module")
def host_path(tiny_model):
    """The host path's run: the prompt's snapshot, the first token, and each step's logits."""
    host = engine(tiny_model)
    token = int(np.argmax(host.prefill(PROMPT)))
    snap = host.kv.snapshot(len(PROMPT))
    host.kv.restore(snap)  # as the device engine will start: ring refilled, pool empty
    tokens, logits = [token], []
    for pos in (*STEPS, AFTER):
        logits.append(host.decode_one_token(tokens[-1], pos))
        tokens.append(int(np.argmax(logits[-1])))
    return snap, tokens, logits


def test_streamed_device_step_equals_host_path(tiny_model, host_path):
    snap, tokens, want = host_path
    dev = engine(tiny_model)
    assert dev.kv.streamed and dev.kv.plan.n_ring == 1
    dev.kv.restore(snap)
    step = dev.device_step()
    lookups_before = dev.kv._counters.lookups
    for i, pos in enumerate(STEPS):
        assert step.run(tokens[i], pos) == tokens[i + 1]
        np.testing.assert_array_equal(step.logits_on_host(), want[i], err_msg=f"at {pos}")
    for L in dev.kv.layers:  # the ring moved on the device: block 1 in slot 0, block 0 gone
        table = dev.be.to_numpy(L.page_table)
        assert table[1] == 0 and table[0] == -1
    counters = dev.kv.counters  # takes the device's maps and counts back
    assert counters.lookups > lookups_before and counters.in_place == counters.misses - counters.copies
    for L in dev.kv.layers:
        assert (L.slots.page_table == dev.be.to_numpy(L.page_table)).all()
        L.slots.check_inverse()
    np.testing.assert_array_equal(dev.decode_one_token(tokens[2], AFTER), want[2])  # from the device's maps


def test_a_dropped_mirror_write_changes_the_replayed_step(tiny_model, host_path):
    """Negative control, the class of Strata #1188: with --fault drop-v-mirror the V half's
    host copy is never written. The replayed step at 16 reads block 0 in place from the
    host copy, so its logits must move; a step that read only VRAM would not."""
    _, tokens, want = host_path
    faulty = engine(tiny_model, fault="drop-v-mirror")
    faulty.prefill(PROMPT + tokens[1:2])  # through position 15, with the host path's token
    step = faulty.device_step()
    step.run(tokens[1], STEPS[1])
    assert np.abs(step.logits_on_host() - want[1]).max() > 1e-3 * np.abs(want[1]).max()
    assert faulty.kv.counters.in_place > 0  # it did read the host copy in place
