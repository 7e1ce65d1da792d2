"""The expert path on the cuda backend, whole engine: the exact oracle (split, K = E)
against the dense model, against the numpy backend, and any cache size against
all-resident, bit for bit, through the host path and the device step (a CUDA graph on a
GPU), fp16 and k8v4 KV; the negative control fails it.

The model: a 1-layer random-weight model (d 64, one head of 64) made an MoE of 4 full
copies of its FFN (ff 64), each token routed to 2 by a random router. Under the simulator
every CUDA thread is a Python thread, so the prompt is 3 tokens and there are 4 steps (with
2, one slot's cache makes no swap yet).

Tolerance against numpy: as test_cuda_backend_forward.py, 1e-3 of the largest logit.
Against all-resident on the same backend: none (the kernels read the same bytes from a
slot as from the host copy, in the same order).
"""
import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb import Engine
from strata_nb.engine import prompt_chunk
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf
from strata_nb.settings import SamplingSettings

pytestmark = pytest.mark.sim_engine
PROMPT = [40, 77, 101]
STEPS = 4
LOGIT_ATOL = 1e-3  # times the largest |logit|


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experts_engine")
    return write_synthetic_gguf(folder / "dense.gguf", n_layers=1, d_model=64, d_ff=64, n_heads=1, n_kv_heads=1,
                                head_dim=64, seed=4)


@pytest.fixture(scope="module")
def copies(dense):
    return str(moefy(dense, dense.parent / "copies.gguf", "copies", 4, used=2, seed=2))


def test_split_with_every_expert_used_is_the_dense_model(dense):
    """The exact oracle on the device: 2 experts of 32 columns, both used, a zero router.
    Logits within the numpy comparison's tolerance of the dense model's, and the same
    greedy tokens (64 steps on a GPU, 4 under the simulator)."""
    split = str(moefy(dense, dense.parent / "split.gguf", "split", 2))
    steps = 64 if ON_GPU else STEPS
    runs = []
    for path in (str(dense), split):
        eng = Engine.load(model=path, device="cuda", max_context=128)
        logits = [eng.prefill(PROMPT)]
        token = int(np.argmax(logits[0]))
        tokens = [token]
        for pos in range(len(PROMPT), len(PROMPT) + steps):
            logits.append(eng.decode_one_token(token, pos))
            token = int(np.argmax(logits[-1]))
            tokens.append(token)
        runs.append((np.stack(logits), tokens))
    (want, want_tokens), (got, got_tokens) = runs
    assert (np.abs(got - want) <= LOGIT_ATOL * np.abs(want).max(axis=1, keepdims=True)).all()
    assert got_tokens == want_tokens


def logits_of(path, device, slots, **more):
    eng = Engine.load(model=path, device=device, max_context=64, expert_cache=slots, adapt_every=1, **more)
    out = [eng.prefill(PROMPT)]
    token = int(np.argmax(out[0]))
    for pos in range(len(PROMPT), len(PROMPT) + STEPS):
        out.append(eng.decode_one_token(token, pos))
        token = int(np.argmax(out[-1]))
    return np.stack(out), eng


@pytest.fixture(scope="module")
def cuda_resident(copies):
    return logits_of(copies, "cuda", "auto")[0]


def test_cuda_experts_match_numpy(copies, cuda_resident):
    want, _ = logits_of(copies, "cpu", "auto")
    scale = np.abs(want).max(axis=1, keepdims=True)
    assert (np.abs(cuda_resident - want) <= LOGIT_ATOL * scale).all()
    assert (cuda_resident.argmax(1) == want.argmax(1)).all()


def test_a_step_routes_distinct_experts_as_numpy_does(dense):
    """Split into 2 distinct experts, each token routed to 1 by a random router: a wrong
    choice in a step gives other logits than numpy's (the copies file cannot show one:
    every expert is the same FFN). Both experts are chosen."""
    split = str(moefy(dense, dense.parent / "split_k1.gguf", "split", 2, used=1, router="random", seed=3))
    want, _ = logits_of(split, "cpu", "auto")
    got, eng = logits_of(split, "cuda", "auto")
    assert (np.abs(got - want) <= LOGIT_ATOL * np.abs(want).max(axis=1, keepdims=True)).all()
    assert (got.argmax(1) == want.argmax(1)).all()
    lookups = eng.be.to_numpy(eng.weights.experts.lookups)
    assert (lookups > 0).all(), lookups


def test_one_slot_gives_the_all_resident_logits_bit_for_bit(copies, cuda_resident):
    got, eng = logits_of(copies, "cuda", 1)
    np.testing.assert_array_equal(got, cuda_resident)
    stats = eng.weights.experts.stats()
    assert stats.swaps > 0 and 0 < stats.hits < stats.lookups


def test_one_slot_with_k8v4_cells_gives_the_all_resident_logits(copies):
    want, _ = logits_of(copies, "cuda", "auto", kv="k8v4")
    got, eng = logits_of(copies, "cuda", 1, kv="k8v4")
    np.testing.assert_array_equal(got, want)
    assert eng.weights.experts.stats().swaps > 0


def test_the_device_step_with_a_small_cache_decodes_the_same_tokens(copies):
    """generate: greedy tokens picked on the device (run_ahead), the cache adapting between steps."""
    runs = {}
    for slots in ("auto", 2):
        eng = Engine.load(model=copies, device="cuda", max_context=64, expert_cache=slots, adapt_every=1)
        tokens = []
        list(eng.generate_ids(PROMPT, SamplingSettings(max_tokens=STEPS + 1), on_token=tokens.append))
        runs[slots] = tokens, eng.last_stats.extra["experts"]
    assert runs[2][0] == runs["auto"][0]
    assert runs[2][1]["copies"] > 0 and runs["auto"][1]["hit_rate"] == 1.0


def test_negative_control_early_resident_is_caught(copies, cuda_resident):
    got, _ = logits_of(copies, "cuda", 2, fault="expert-early-resident")
    assert not np.array_equal(got, cuda_resident)


LONG_PROMPT = [40, 77, 101, 5, 9, 63, 12, 88, 31, 70]  # more rows than a verify window: a prompt chunk's path


def prefill_logits(path, slots):
    eng = Engine.load(model=path, device="cuda", max_context=64, expert_cache=slots)
    return eng.prefill(LONG_PROMPT), eng


def test_a_prompt_chunk_reads_each_missed_expert_from_its_transit_slot(copies):
    """A prompt chunk copies each expert it misses into a transit slot once
    (fast/fetch_misses.py) and its expert kernels read it there: with no slot
    at all, the logits of every expert resident, bit for bit, and each expert the chunk
    chose is in its transit slot afterwards."""
    want, _ = prefill_logits(copies, "auto")
    got, eng = prefill_logits(copies, 0)
    np.testing.assert_array_equal(got, want)
    cache = eng.weights.experts
    assert cache.n_transit == 4 and cache.transit == 0
    chosen = np.flatnonzero(eng.be.to_numpy(cache.lookups))  # one layer: entry = expert
    slots, host = eng.be.to_numpy(cache.slot_gate_up), np.asarray(cache.host_gate_up)
    assert len(chosen) >= 2
    for e in chosen:
        np.testing.assert_array_equal(slots[cache.transit + e], host[e])


def test_negative_control_a_lookup_pointed_at_a_transit_slot_never_filled_is_caught(copies, monkeypatch):
    """fetch_misses pointing the chunk's lookups at the transit slots but copying nothing
    into them (they hold zeros; the copies file's experts are all alike, so only missing
    bytes show): the chunk's logits change, so the test above can fail."""
    from strata_nb.fast import backend as cuda_backend

    fetch = cuda_backend.fetch_misses

    def unfilled(chosen, slot_of, res, at, host_gu, host_down, *rest):
        fetch(chosen, slot_of, res, at, *(np.zeros_like(host.copy_to_host()) for host in (host_gu, host_down)), *rest)

    want, _ = prefill_logits(copies, "auto")
    monkeypatch.setattr(cuda_backend, "fetch_misses", unfilled)
    got, _ = prefill_logits(copies, 0)
    assert not np.array_equal(got, want)


def test_a_padded_prompt_chunk_counts_only_its_tokens(copies, monkeypatch):
    """A prompt chunk replayed from device memory (engine/prompt_chunk.py, on as on a GPU)
    is padded to its width with its last token: 3 tokens in a chunk of 16 rows. The expert
    cache counts the 3 tokens' choices, as the numpy backend does, not the 16 rows'."""
    monkeypatch.setattr(prompt_chunk, "_ON", True)
    counts = {}
    for device in ("cuda", "cpu"):
        eng = Engine.load(model=copies, device=device, max_context=64, prefill_chunk=16, expert_cache=2)
        if device == "cuda":
            assert eng.prompt_chunks() is not None  # the padded path, not the host-launched one
        eng.prefill(PROMPT)
        counts[device] = eng.weights.experts.stats()
    assert counts["cuda"].lookups == counts["cpu"].lookups == len(PROMPT) * 2  # K = 2, one layer
    assert counts["cuda"].hits == counts["cpu"].hits


def test_a_padded_verify_window_counts_only_its_tokens(copies):
    """A verify window (engine/verify_window.py) of 4 rows run with 2 tokens is padded with
    its last: the expert cache counts the 2 tokens' choices, as the host path's pass over
    the 2 does."""
    from strata_nb.engine.verify_window import VerifyWindow

    counts = {}
    for path in ("window", "host"):
        eng = Engine.load(model=copies, device="cuda", max_context=64, expert_cache=2)
        eng.prefill(PROMPT)
        before = eng.weights.experts.stats().lookups
        if path == "window":
            VerifyWindow(eng.be, eng.weights, eng.kv, 4, use_graph=False).run([5, 9], len(PROMPT))
        else:
            eng.verify([5, 9], len(PROMPT))
        eng.kv.keep(2)
        counts[path] = eng.weights.experts.stats().lookups - before
    assert counts["window"] == counts["host"] == 2 * 2  # 2 tokens, K = 2, one layer


def test_rows_alone_an_moe_prompt_resumed_mid_chunk_writes_the_same_cells(dense, monkeypatch):
    """Rows alone (engine/prompt_chunk.py, on): a prompt of 11 tokens in chunks
    of 16, and the same prompt resumed at 9 (a chunk of 2 rows), through a random router
    over 2 distinct experts, write the same cells and give the same logits, bit for bit.
    The model has one layer, so the experts reach the logits (the last token's row, in a
    chunk of 11 rows and of 2): the expert kernels compute a token alone, whatever rows
    share its launch."""
    monkeypatch.setattr(prompt_chunk, "_ON", True)
    split = str(moefy(dense, dense.parent / "split_rows_alone.gguf", "split", 2, used=2, router="random", seed=3))
    prompt = [40, 77, 101, 5, 60, 33, 91, 12, 8, 70, 44]
    results = []
    for prefills in ([(prompt, 0)], [(prompt[:9], 0), (prompt, 9)]):
        eng = Engine.load(model=split, device="cuda", max_context=32, prefill_chunk=16)
        for ids, start in prefills:
            logits = eng.prefill(ids, start=start)
        snap = eng.kv.snapshot(len(prompt))["layers"][0]
        results.append((logits, {f: a.swapaxes(1, 2).reshape(-1, *a.shape[1:2], *a.shape[3:])[:len(prompt)]
                                 for f, a in snap.items()}))
    (want, want_cells), (got, got_cells) = results
    assert got.tobytes() == want.tobytes()
    assert all(got_cells[f].tobytes() == want_cells[f].tobytes() for f in want_cells)
