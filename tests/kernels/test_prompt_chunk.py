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
from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.bench.check import GAP_TOL, LAYER0_TOL
from strata_nb.engine.engine import Engine
from strata_nb.engine import prompt_chunk
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


def test_prepare_captures_the_widths_a_prefill_will_replay(monkeypatch):
    """The bench captures a prefill's graphs before timing it: one per chunk, at its
    width, and none for a chunk whose padding would pass the cache's end."""
    from types import SimpleNamespace

    from strata_nb.engine.prompt_chunk import PromptChunks

    kv = SimpleNamespace(n_blocks=512, fmt="fp16", qsa_budget=0)  # 8,192 cells
    chunks = PromptChunks(NumpyBackend(), SimpleNamespace(token_embd=None, experts=None), kv, 2048, False)
    captured = []
    monkeypatch.setattr(chunks, "_capture", lambda p: captured.append(p.width))
    chunks.prepare(4125)
    assert captured == [2048, 2048, 32]
    captured.clear()
    chunks.prepare(60, start=8150)  # 64 rows from 8,150 would pass 8,192
    assert captured == []


def test_warm_runs_every_width_that_fits_twice(monkeypatch):
    """`strata-nb serve` warms every width at start (launched, then captured and replayed),
    each from position 0, where it fits the cache."""
    from types import SimpleNamespace

    from strata_nb.engine.prompt_chunk import PromptChunks, ladder

    assert ladder(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048] and ladder(100) == [16, 32, 64, 100]
    kv = SimpleNamespace(n_blocks=32, fmt="fp16", qsa_budget=0)  # 512 cells
    chunks = PromptChunks(NumpyBackend(), SimpleNamespace(token_embd=None, experts=None), kv, 2048, False)
    ran = []
    monkeypatch.setattr(chunks, "run", lambda ids, start: ran.append((len(ids), start)))
    chunks.warm(7)
    assert ran == [(w, 0) for w in (16, 32, 64, 128, 256, 512) for _ in range(2)]


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
    monkeypatch.setattr(prompt_chunk, "_ON", True)
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu", prefill_chunk=CHUNK)
    model = GGUFModel(tiny_model)
    want_logits, want_tokens = greedy(Engine(settings, model, NumpyBackend()))
    eng = Engine(settings, model, FastCudaBackend())
    got_logits, got_tokens = greedy(eng)
    assert set(eng.prompt_chunks().passes) == {CHUNK}  # both chunks ran through it: the second padded
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        assert_logits_close(got, want)
    k = eng.be.to_numpy(eng.kv.layers[0].pool["k"])[:, 0].reshape(-1, eng.config.head_dim)  # by position
    assert np.abs(k[len(PROMPT) + STEPS:2 * CHUNK]).max() > 0  # the padding's cells were written


def test_on_where_asked_and_never_for_a_streamed_cache(tiny_model, monkeypatch):
    """The path runs on the cuda backend where it is on (a GPU's default), never on the
    numpy backend, and never for a streamed cache (its chunks stage earlier blocks from
    the host copy first)."""
    from strata_nb.kv.plan import StreamPlan

    model = GGUFModel(tiny_model)
    resident = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu")
    monkeypatch.setattr(prompt_chunk, "_ON", False)
    assert Engine(resident, model, FastCudaBackend()).prompt_chunks() is None
    monkeypatch.setattr(prompt_chunk, "_ON", True)
    assert Engine(resident, model, FastCudaBackend()).prompt_chunks() is not None
    assert Engine(resident, model, NumpyBackend()).prompt_chunks() is None
    streamed = Settings(model=tiny_model, kv="fp16", max_context=128, device="cpu", kv_window=16,
                        kv_resident=StreamPlan.minimum_cells(16))
    assert Engine(streamed, model, FastCudaBackend(), quiet=True).prompt_chunks() is None


@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a GPU (STRATA_NB_GPU=1)")
@pytest.mark.parametrize("kv", ["fp16", "k8v4"])
def test_replayed_chunks_equal_launched_ones(default_model_path, monkeypatch, kv):
    """On a GPU: a prefill whose chunks are replayed from graphs (a full chunk and a padded
    tail; the engine that launched them one by one compiled them, so each width is
    captured at its first use) gives the bits the same chunks give launched one by one,
    logits and cells, as does a prefill resumed mid-chunk (rows alone); and the logits
    are the host path's: within LOGIT_ATOL for fp16 cells; for k8v4, whose q4_0 V codes
    flip on a rounding difference and carry it on through the layers (bench/check.py), the
    host path's top token is ours or within GAP_TOL of it, and layer 0's cells, which no
    flip reaches, differ in at most LAYER0_TOL of their bytes."""
    from importlib import resources

    monkeypatch.setattr(prompt_chunk, "_ON", True)
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
    resumed = Engine.load(**common)  # rows alone: a prefill resumed mid-chunk writes the same cells
    resumed.prefill(ids[:300])
    assert resumed.prefill(ids, start=300).tobytes() == want.tobytes()
    for a, b in zip(launched.kv.snapshot(len(ids))["layers"], resumed.kv.snapshot(len(ids))["layers"]):
        assert all(np.array_equal(prompt_cells(a[f], len(ids)), prompt_cells(b[f], len(ids))) for f in a), \
            "a resumed prefill wrote other cells"
    monkeypatch.setattr(prompt_chunk, "_ON", False)
    host = Engine.load(**common)
    host_logits = host.prefill(ids)
    if kv == "fp16":
        assert_logits_close(got, host_logits)
        return
    assert host_logits.max() - host_logits[int(np.argmax(got))] <= GAP_TOL
    a, b = launched.kv.snapshot(len(ids))["layers"][0], host.kv.snapshot(len(ids))["layers"][0]
    for f in a:
        x, y = prompt_cells(a[f], len(ids)), prompt_cells(b[f], len(ids))
        assert np.mean(x.view(np.uint8) != y.view(np.uint8)) <= LAYER0_TOL, f"layer 0's {f} differs"


def cells_and_logits(tiny_model, prefills, **settings):
    """(last logits, every layer's cells of the prompt) after the given prefills, each
    (ids, start), on the cuda backend."""
    s = Settings(model=tiny_model, device="cpu", prefill_chunk=CHUNK, **({"max_context": 64, "kv": "fp16"} | settings))
    eng = Engine(s, GGUFModel(tiny_model), FastCudaBackend(), quiet=True)
    for ids, start in prefills:
        logits = eng.prefill(ids, start=start)
    return logits, eng.kv.snapshot(len(PROMPT))["layers"]


def prompt_cells(a, n: int = len(PROMPT)):
    """A snapshot array (blocks, n_kv, 16, per_head) cut to a prompt's n cells (the rest
    of its last block holds a padding's cells, or none)."""
    return a.swapaxes(1, 2).reshape(-1, *a.shape[1:2], *a.shape[3:])[:n]


def assert_same_bits(a, b):
    assert a[0].tobytes() == b[0].tobytes(), "the logits differ"
    for la, lb in zip(a[1], b[1]):
        for field in la:
            assert prompt_cells(la[field]).tobytes() == prompt_cells(lb[field]).tobytes(), f"cells of {field} differ"


@pytest.mark.sim_engine  # six prefills under the simulator: about two minutes
def test_a_prompt_resumed_at_any_token_writes_one_prefill_s_cells(tiny_model, monkeypatch):
    """Rows alone (engine/prompt_chunk.py), what lets a conversation cache resume anywhere:
    a prefill resumed at token 11, and at 19 (a chunk of 2 rows), writes the cells of one
    prefill of all 21, every layer, and gives its logits, bit for bit. So does a streamed
    cache, whose chunks run from the host through the stage. (The path of before, resumed
    at 19, happened to give the same bits too under the simulator for this model, so the
    negative control is the kernel's: test_attention_prompt.py's rows-alone test.)"""
    from strata_nb.kv.plan import StreamPlan

    monkeypatch.setattr(prompt_chunk, "_ON", True)
    whole = cells_and_logits(tiny_model, [(PROMPT, 0)])
    for k in (11, 19):
        assert_same_bits(whole, cells_and_logits(tiny_model, [(PROMPT[:k], 0), (PROMPT, k)]))
    streamed = dict(max_context=128, kv_window=16, kv_resident=StreamPlan.minimum_cells(16))
    assert_same_bits(whole, cells_and_logits(tiny_model, [(PROMPT, 0)], **streamed))


@pytest.mark.sim_engine  # three prefills under the simulator: about a minute
def test_rows_alone_in_k8v4_with_qsa(tiny_model, monkeypatch):
    """The same for k8v4 cells (V rotated as it is quantized, attention's output rotated
    back) with QSA's key sketch, resumed at 19: cells, sketch and logits bit for bit."""
    monkeypatch.setattr(prompt_chunk, "_ON", True)
    k8v4 = dict(kv="k8v4", qsa_budget=32)
    assert_same_bits(cells_and_logits(tiny_model, [(PROMPT, 0)], **k8v4),
                     cells_and_logits(tiny_model, [(PROMPT[:19], 0), (PROMPT, 19)], **k8v4))
