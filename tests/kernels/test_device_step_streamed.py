"""A streamed cache's decode step on the device (kv/cache.py: StepBlocks, map_ring,
select_blocks) against the host path, on the cuda backend: QSA, two steps that cross into
a new block (the ring moves on), then a step on the host path again. (Dense streaming
takes the same route with every block up to the query selected: test_step_selection.py
checks that choice.)

The host path resolves misses into slots by CLOCK and copies them; the device step reads
them in place from the host copy. The bytes are the same, so the logits must be equal bit
for bit. Afterwards the host's maps must be the device's, and the device's lookups must
be in the counters: the host path's next decisions start from them.

The tiny model (2 layers, 1 KV head) with a ring of 1 block and a pool of 4, 48 prompt
tokens over 3 blocks, prefilled once and restored into the second engine: under the
simulator each forward pass takes seconds.
"""
import numpy as np

from strata_nb.backend.cuda_backend import CudaBackend
from strata_nb.engine.engine import Engine
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import Settings

PROMPT = [3 + (7 * i) % 90 for i in range(47)]  # positions 0..46: blocks 0, 1, 2


def engine(tiny_model, qsa):
    settings = Settings(model=tiny_model, kv="k8v4", max_context=128, kv_window=16, kv_resident=80,
                        qsa_budget=qsa, device="cuda")
    return Engine(settings, GGUFModel(tiny_model), CudaBackend())


def test_streamed_device_step_equals_host_path(tiny_model):
    host, dev = engine(tiny_model, 48), engine(tiny_model, 48)
    assert host.kv.streamed and dev.kv.plan.n_ring == 1
    token = int(np.argmax(host.prefill(PROMPT)))
    snap = host.kv.snapshot(len(PROMPT))
    host.kv.restore(snap)  # both caches from the same bytes, ring refilled, pools empty
    dev.kv.restore(snap)
    step = dev.device_step()
    lookups_before = dev.kv._counters.lookups
    for pos in (47, 48):  # 48 enters block 3: the ring leaves block 2
        want = host.decode_one_token(token, pos)
        picked = step.run(token, pos)
        np.testing.assert_array_equal(step.logits_on_host(), want, err_msg=f"at {pos}")
        token = picked
    for L in dev.kv.layers:  # the ring moved on the device: block 3 in slot 0, block 2 gone
        assert dev.be.to_numpy(L.page_table)[3] == 0 and dev.be.to_numpy(L.page_table)[2] != 0
    counters = dev.kv.counters  # takes the device's maps and counts back
    assert counters.lookups > lookups_before and counters.in_place == counters.misses - counters.copies
    for L in dev.kv.layers:
        assert (L.slots.page_table == dev.be.to_numpy(L.page_table)).all()
        L.slots.check_inverse()
    want = host.decode_one_token(token, 49)  # the host path again, from the device's maps
    np.testing.assert_array_equal(dev.decode_one_token(token, 49), want)
