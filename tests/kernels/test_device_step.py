"""The replayable decode step (engine/decode_step.py) against the host path, on the cuda
backend: the same kernels on the same bytes, so the same logits bit for bit and the same
tokens. Under the simulator the step launches kernel by kernel; on a GPU
(STRATA_NB_GPU=1) it is captured into a CUDA graph and replayed, and must still agree.

fp16 and k8v4: k8v4 takes every other route there is through append (two folded halves,
the int8 and q4_0 writers) and attention (rotated V comes back through a Hadamard). One
engine serves both paths: each step is decoded by the host path, then again by the device
step, which rewrites the same cell with the same bytes.
"""
import numpy as np
import pytest

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.decode_step import DeviceStep
from strata_nb.engine.engine import Engine
from strata_nb.errors import StrataError
from strata_nb.fast.advance_step import advance_step, advance_step_ref
from strata_nb.kernels.kv.hadamard import hadamard, hadamard_ref
from strata_nb.gpu.launch import Capture, capturing
import strata_nb.fast.attention_step as attention_step_module
from strata_nb.kernels.step.sample_top_p import sample_top_p_ref
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import SamplingSettings, Settings

pytestmark = pytest.mark.sim_engine  # the decode step end to end under the simulator: minutes on a CPU

PROMPT = [3 + ord("t")]  # one token: the simulator spends seconds per forward pass
STEPS = 2


def engine(tiny_model, kv, max_context=64, **kw):
    settings = Settings(model=tiny_model, kv=kv, max_context=max_context, device="cuda", **kw)
    return Engine(settings, GGUFModel(tiny_model), FastCudaBackend())


def test_advance_step_kernel_equals_ref():
    for impl in (advance_step_ref, advance_step):
        token, pos, chosen = (np.array([v], np.int32) for v in (41, 7, 0))
        impl(token, pos, chosen)
        assert (int(token[0]), int(pos[0]), int(chosen[0])) == (41, 8, 41), impl.__name__
        ring = np.zeros(4, np.int32)  # the pick ring run_ahead uses: position 8 -> slot 0, 9 -> slot 1
        for _ in range(2):
            impl(token, pos, ring)
        assert list(ring) == [41, 41, 0, 0] and int(pos[0]) == 10, impl.__name__


@pytest.mark.parametrize("kv", ["fp16", "k8v4"])
def test_device_step_equals_host_path(tiny_model, kv):
    eng = engine(tiny_model, kv)
    step = eng.device_step()
    assert step is not None
    token = int(np.argmax(eng.prefill(PROMPT)))
    for i in range(STEPS):
        pos = len(PROMPT) + i
        want = eng.decode_one_token(token, pos)
        picked = step.run(token, pos)
        np.testing.assert_array_equal(step.logits_on_host(), want, err_msg=f"{kv} step {i}")
        assert picked == int(np.argmax(want))
        token = picked


def test_a_step_early_in_the_context_reads_a_narrow_list(tiny_model, monkeypatch):
    """A resident step reads only the list's first `two_per_sm_columns` blocks while its
    query lies in them (the step attention's two-an-SM build), and the whole list after:
    a graph for each width on a GPU, the host path's bits on either side."""
    monkeypatch.setattr(attention_step_module, "multiprocessors", lambda: 1)  # 2 splits of 4 blocks: 128 cells
    eng = engine(tiny_model, "fp16", max_context=256)
    step = eng.device_step()
    assert step.kv.step.narrow == 8
    token = int(np.argmax(eng.prefill(PROMPT)))
    for pos in (126, 127, 128, 129):  # two steps a width: the second captures its graph on a GPU
        want = eng.decode_one_token(token, pos)
        picked = step.run(token, pos)
        np.testing.assert_array_equal(step.logits_on_host(), want, err_msg=f"position {pos}")
        token = picked
    assert step.widths_launched == {8, 16}
    assert set(step.graphs) == ({8, 16} if step.use_graph else set())


def test_host_sampled_tokens_are_written_back(tiny_model):
    """Top-k sampling happens on the host, from the step's logits; its token overrides the
    device's pick: generate with the device step equals generate on the host path."""
    s = SamplingSettings(max_tokens=2, temperature=1.5, top_k=20, seed=3)
    a, b = engine(tiny_model, "fp16"), engine(tiny_model, "fp16")
    b.reply_step = lambda *args: None  # the host path
    got, want = [], []
    "".join(a.generate_ids(PROMPT, s, on_token=got.append))
    "".join(b.generate_ids(PROMPT, s, on_token=want.append))
    assert got == want and len(got) == 2


def test_replies_reuse_one_step_and_equal_a_fresh_engines(tiny_model):
    """A server's replies share the decode step (its graph, on a GPU) where the kind of pick
    matches: the second reply, after another prompt's prefill wrote cells at the same
    positions, gives a fresh engine's tokens, and a sampled reply gets a step of its own."""
    greedy = SamplingSettings(max_tokens=3)
    eng, fresh = engine(tiny_model, "fp16"), engine(tiny_model, "fp16")
    other = [3 + ord("a")]
    got, want = [], []
    "".join(eng.generate_ids(PROMPT, greedy))
    rng = np.random.default_rng(0)
    first = eng.reply_step(greedy, rng)
    "".join(eng.generate_ids(other, greedy, on_token=got.append))
    "".join(fresh.generate_ids(other, greedy, on_token=want.append))
    assert got == want and len(got) == 3
    assert eng.reply_step(greedy, rng) is first
    drawn = SamplingSettings(temperature=0.8, top_p=0.9, seed=11)
    assert eng.reply_step(drawn, rng) is not first and eng.reply_step(drawn, rng) is eng.reply_step(drawn, rng)


def test_top_p_draws_on_the_device(tiny_model):
    """Temperature and top-p without top-k: the step draws with sample_top_p, seeded by the
    seed and the position, the same token as the reference on the host path's logits."""
    eng = engine(tiny_model, "fp16")
    s = SamplingSettings(temperature=0.8, top_p=0.9, seed=11)
    step = eng.device_step(s)
    assert step.picks and step.draw is not None
    token, pos = int(np.argmax(eng.prefill(PROMPT))), len(PROMPT)
    want_logits = eng.decode_one_token(token, pos)
    want = np.zeros(1, np.int32)
    sample_top_p_ref(want_logits, np.float32(1 / 0.8), np.float32(0.9), 11, np.array([pos], np.int32), want)
    assert step.run(token, pos) == int(want[0])


def test_every_cache_gets_a_device_step_on_cuda_and_none_on_numpy(tiny_model):
    """QSA and streamed caches select and map on the device (test_device_step_streamed.py);
    the numpy backend always takes the host path."""
    eng = engine(tiny_model, "fp16", qsa_budget=32)
    assert eng.device_step() is not None and DeviceStep.supported(eng.be, eng.kv)
    cpu = Engine(Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu"), GGUFModel(tiny_model),
                 NumpyBackend())
    assert cpu.device_step() is None


def test_a_position_past_the_cache_is_an_error(tiny_model):
    step = engine(tiny_model, "fp16").device_step()
    with pytest.raises(StrataError, match="outside the KV cache's 64 cells"):
        step.run(5, 64)


def test_capture_keeps_its_allocations_and_refuses_numpy():
    """While a capture is open, launchers allocate through device_empty (kept alive for the
    graph) and a NumPy argument, which would be a host copy frozen into the graph, fails."""
    from numba import cuda

    keep = []
    x = cuda.to_device(np.ones((2, 64), np.float32))
    with capturing(0, keep):
        out = hadamard(x)
        assert keep[-1] is out
        with pytest.raises(AssertionError, match="during graph capture"):
            hadamard(np.ones((2, 64), np.float32))
    assert Capture.keep is None and Capture.stream == 0
    np.testing.assert_allclose(out.copy_to_host(), hadamard_ref(np.ones((2, 64), np.float32)), atol=1e-6)


@pytest.mark.parametrize("kv, kw, newer", [("k8v4", dict(kv_window=16, kv_resident=80), True),
                                           ("fp16", dict(qsa_budget=32), True), ("fp16", {}, False)])
def test_a_queued_pass_marks_the_device_s_maps_newer(tiny_model, kv, kw, newer):
    """A graph's replay runs none of the launches' Python, so the step and the verify window
    themselves tell the cache that the device may have moved its ring and counted lookups:
    the host's next decision must take the device's maps first (KVCache.sync_from_device).
    A fully resident dense cache makes no decision on the device."""
    eng = engine(tiny_model, kv, max_context=128, spec=4, **kw)
    windows, step = eng.spec_passes()
    window = windows[4]
    for queued in (lambda: step._queue(0).synchronize(), lambda: window.run([5, 6], 0)):
        step.launch = window.launch = lambda: None  # as a replay: no Python of the launches runs
        eng.kv.sync_from_device()
        assert not eng.kv._device_newer
        queued()
        assert eng.kv._device_newer == newer
