"""The verify window on the cuda backend (engine/verify_window.py): T positions in one
pass whose inputs live in device memory, replayed from a CUDA graph on a GPU, launched one
by one under the simulator. With greedy sampling, --spec must give the tokens --spec 0
gives, and write the same cells: on this backend a window's row of every product sums in
the one-token path's order, so the caches must agree bit for bit (the numpy backend's
BLAS cannot promise that: tests/test_speculation.py). A streamed cache's host copy must
mirror its VRAM slots.

Under the simulator: the tiny model, its prompt's cells written once by the numpy backend
and restored; the first pass after the prompt's last token is a window at 31, across
block 2 at 32. With a ring of one block (--kv-window 16) the pass that enters block 2
moves the ring off block 1, whose cells the same window wrote: the following queries
read them in place from the host copy (the #1188 case). On a GPU (STRATA_NB_GPU=1) the
default model continues its bundled document in every KV format, resident and streamed
at the minimum resident size, with and without QSA.
"""
from importlib import resources

import pytest

from conftest import ON_GPU
from strata_nb import Engine
from strata_nb.kv.plan import StreamPlan
from strata_nb.kv_layout import BLOCK
from strata_nb.probes import mirror_mismatches
from strata_nb.settings import SamplingSettings
from test_speculation import differing_share

pytestmark = pytest.mark.sim_engine  # the whole engine through the kernels: minutes under the simulator

STREAMED = dict(kv_window=16, kv_resident=StreamPlan.minimum_cells(16))  # a ring of 1 block, a pool of 4
if ON_GPU:
    FORMATS = ("fp16", "int8", "q4_0", "k8v4")
    CONFIGS = [(fmt, extra) for fmt in FORMATS for extra in ({}, STREAMED, STREAMED | dict(qsa_budget=64))]
    N_PROMPT, N_NEW, WINDOW, CONTEXT = 150, 64, 5, 512
else:
    CONFIGS = [("k8v4", STREAMED | dict(qsa_budget=32))]  # QSA keeps block 0 and the ring's: minutes here
    # A decode step or a window costs seconds here (its matvecs a warp reduction per row of
    # W and of x), a prompt cell on the numpy backend a millisecond: the prompt runs up to
    # the boundary at 32, and 3 tokens cross it (a decode step at 30, one window at 31).
    N_PROMPT, N_NEW, WINDOW, CONTEXT = 31, 3, 4, 128
# The backend that writes the prompt's cells, restored into both runs: the cells' format is
# the cache's, whichever backend wrote them (a cuda prefill is a minute under the simulator)
PREFILL_DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="module")
def model(tiny_model, request):
    return request.getfixturevalue("default_model_path") if ON_GPU else tiny_model


@pytest.fixture(scope="module")
def prompt(model):
    if not ON_GPU:
        # ends in two of the token the tiny model then repeats (12), so the drafter has a
        # 2-token match at once: the pass after the prompt's last token (a decode step at
        # 30) is a window at 31, [12, its draft 12], that writes 31 and enters block 2 at 32
        return [3 + (7 * i) % 90 for i in range(N_PROMPT - 2)] + [12, 12]
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    return Engine.load(model=model, device="cpu", max_context=CONTEXT).tokenize(text)[:N_PROMPT]


_prefilled: dict = {}


def run(model, prompt, spec, kv, **settings):
    """(greedy tokens, engine, verify windows (pos, length)) from the prompt's cells, all
    but its last token's restored from one prefill per format and plan (on PREFILL_DEVICE)."""
    key = (kv, tuple(sorted(settings.items())))
    if key not in _prefilled:
        writer = Engine.load(model=model, device=PREFILL_DEVICE, max_context=CONTEXT, kv=kv, **settings)
        writer.prefill(prompt[:-1])
        _prefilled[key] = writer.kv.snapshot(N_PROMPT - 1)
    eng = Engine.load(model=model, device="cuda", max_context=CONTEXT, spec=spec, kv=kv, **settings)
    eng.kv.restore(_prefilled[key])
    windows = []
    if spec:  # note each device window's (pos, length)
        for window in eng.spec_passes()[0].values():
            window.run = (lambda plain_run: lambda w, pos: (windows.append((pos, len(w))), plain_run(w, pos))[1])(
                window.run)
    tokens = []
    list(eng.generate_ids(prompt, SamplingSettings(max_tokens=N_NEW), on_token=tokens.append, cached=N_PROMPT - 1))
    return tokens, eng, windows


@pytest.mark.parametrize("kv, settings", CONFIGS, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "resident")
def test_the_window_gives_the_one_token_path_s_tokens_and_cells(kv, settings, model, prompt):
    want, step_eng, _ = run(model, prompt, 0, kv, **settings)
    got, eng, windows = run(model, prompt, WINDOW, kv, **settings)
    assert got == want
    counts = eng.last_stats.extra["spec"]
    assert windows and counts["drafts_accepted"] > 0  # the device window ran, and kept drafts
    assert any(pos // BLOCK != (pos + n - 1) // BLOCK for pos, n in windows)  # a window crossed a block boundary
    end = N_PROMPT + len(got) - 1  # the cells both runs wrote: the last token is never appended
    assert differing_share(eng.kv.snapshot(end), step_eng.kv.snapshot(end), end) == 0  # bit for bit
    if eng.kv.streamed:
        assert mirror_mismatches(eng.kv, end) == 0



@pytest.mark.skipif(not ON_GPU, reason="graphs are captured only on a GPU")
def test_top_k_on_a_streamed_cache_replays_as_it_launches(model, prompt):
    """Top-k sampling reads each step's logits on the host and syncs the ring's maps from
    the device before the next step: a replayed graph runs no Python, so the step itself
    must mark the device's maps newer (KVCache.device_pass_queued), or the host would map
    the ring from stale maps. Replayed and launched steps must draw the same tokens."""
    outs = []
    for graph in (True, False):
        eng = Engine.load(model=model, device="cuda", max_context=CONTEXT, kv="k8v4", graph=graph, **STREAMED)
        outs.append(list(eng.generate_ids(prompt, SamplingSettings(max_tokens=N_NEW, temperature=0.8, top_k=20,
                                                                    seed=5))))
    assert outs[0] == outs[1]
