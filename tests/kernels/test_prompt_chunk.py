"""Prompt chunks whose inputs live in device memory (engine/prompt_chunk.py), replayed from
graphs on a GPU, launched one by one under the simulator: the widths a prompt's chunks
run as, and a prefill through them against the numpy backend's, on the tiny model
(2 layers, fp16 cells; test_cuda_backend_forward.py says why logits agree within
LOGIT_ATOL of the largest).

The prompt is 21 tokens in chunks of 16: a full chunk, then 5 tokens padded to 16 rows
whose cells (21..31) lie past the prompt. The greedy steps after it decode at 21 and 22,
in the block those padded cells share: each step writes its cell, and no query may see
the cells after its own.
"""
import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.backend.cuda_backend import CudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.engine import Engine
from strata_nb.engine.prompt_chunk import MIN_WIDTH, width_for
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import Settings
from test_cuda_backend_forward import assert_logits_close

PROMPT = [3 + ord(c) for c in "the cat sat on the mat"][:21]
CHUNK = 16
STEPS = 2


def test_a_chunk_runs_as_the_next_width_up():
    assert [width_for(n, 2048) for n in (1, 16, 17, 33, 1000, 1025, 2047, 2048)] == \
        [MIN_WIDTH, 16, 32, 64, 1024, 2048, 2048, 2048]
    assert [width_for(n, 256) for n in (5, 200, 256)] == [16, 256, 256]
    assert width_for(3, 8) == 8  # never wider than the chunk


def plan(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """(start, width) of each chunk Engine.prefill runs from `start`."""
    return [(at, width_for(min(chunk, end - at), chunk)) for at in range(start, end, chunk)]


def test_a_prefill_resumed_at_a_chunk_boundary_reruns_the_cold_chunks():
    """The conversation cache resumes a prompt at a whole chunk (serve/conversations.py):
    the chunks it runs must be the cold prefill's last ones, with the same widths, or the
    cached reply's cells would be computed another way than a cold server's."""
    for end in (4125, 4096, 2049, 300):
        cold = plan(0, end, 2048)
        for k in range(len(cold)):
            assert plan(k * 2048, end, 2048) == cold[k:]


def greedy(engine):
    """Prefill logits and STEPS greedy tokens with their logits."""
    logits = [engine.prefill(PROMPT)]
    tokens = [int(np.argmax(logits[0]))]
    for step in range(STEPS):
        logits.append(engine.decode_one_token(tokens[-1], len(PROMPT) + step))
        tokens.append(int(np.argmax(logits[-1])))
    return logits, tokens


@pytest.mark.sim_engine  # ~40 s under the simulator
def test_prefill_in_device_chunks_matches_numpy(tiny_model, monkeypatch):
    monkeypatch.setenv("STRATA_NB_DEVICE_PROMPT", "1")
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu", prefill_chunk=CHUNK)
    model = GGUFModel(tiny_model)
    want_logits, want_tokens = greedy(Engine(settings, model, NumpyBackend()))
    eng = Engine(settings, model, CudaBackend())
    got_logits, got_tokens = greedy(eng)
    assert set(eng.prompt_chunks().passes) == {CHUNK}  # both chunks ran through it: the second padded
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        assert_logits_close(got, want)
    k = eng.be.to_numpy(eng.kv.layers[0].pool["k"])[:, 0].reshape(-1, eng.config.head_dim)  # by position
    assert np.abs(k[len(PROMPT) + STEPS:2 * CHUNK]).max() > 0  # the padding's cells were written


def test_off_by_default_and_for_a_streamed_cache(tiny_model, monkeypatch):
    """Until measured on a GPU the path is opt-in, and never for a streamed cache (its
    chunks stage earlier blocks from the host copy first)."""
    from strata_nb.kv.plan import StreamPlan

    model = GGUFModel(tiny_model)
    resident = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu")
    monkeypatch.delenv("STRATA_NB_DEVICE_PROMPT", raising=False)
    assert Engine(resident, model, CudaBackend()).prompt_chunks() is None
    monkeypatch.setenv("STRATA_NB_DEVICE_PROMPT", "1")
    assert Engine(resident, model, CudaBackend()).prompt_chunks() is not None
    assert Engine(resident, model, NumpyBackend()).prompt_chunks() is None
    streamed = Settings(model=tiny_model, kv="fp16", max_context=128, device="cpu", kv_window=16,
                        kv_resident=StreamPlan.minimum_cells(16))
    assert Engine(streamed, model, CudaBackend(), quiet=True).prompt_chunks() is None


@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a GPU (STRATA_NB_GPU=1)")
@pytest.mark.parametrize("kv", ["fp16", "k8v4"])
def test_replayed_chunks_equal_launched_ones(default_model_path, monkeypatch, kv):
    """On a GPU: a prefill whose chunks are replayed from graphs (a full chunk and a padded
    tail; the engine that launched them one by one compiled them, so each width is
    captured at its first use) gives the bits the same chunks give launched one by one,
    logits and cells; and the logits are the host path's within LOGIT_ATOL."""
    from importlib import resources

    monkeypatch.setenv("STRATA_NB_DEVICE_PROMPT", "1")
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    common = dict(model=default_model_path, device="cuda", kv=kv, max_context=2048, prefill_chunk=256)
    launched = Engine.load(graph=False, **common)
    ids = launched.tokenize(text)[:2 * 256 + 37]
    want = launched.prefill(ids)
    replayed = Engine.load(**common)
    for _ in range(2):  # captured (and replayed), replayed
        got = replayed.prefill(ids)
    assert {w: p.graph is not None for w, p in replayed.prompt_chunks().passes.items()} == {256: True, 64: True}
    assert got.tobytes() == want.tobytes()
    for a, b in zip(launched.kv.snapshot(len(ids))["layers"], replayed.kv.snapshot(len(ids))["layers"]):
        assert all(np.array_equal(a[f], b[f]) for f in a), "a replayed chunk wrote other cells"
    monkeypatch.setenv("STRATA_NB_DEVICE_PROMPT", "0")
    assert_logits_close(got, Engine.load(**common).prefill(ids))
