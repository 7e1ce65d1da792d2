"""Speculative decoding with a verify window (--spec), on the numpy backend: the drafter;
greedy output token-identical to --spec 0 in every KV format, resident and streamed at the
minimum resident size, with and without QSA; and the parity tests with their negative
controls:

- mirror parity: every cell in a VRAM slot equals its host copy, bit for bit; the verify
  window's batched append skipping the host copy (--fault verify-no-mirror, Strata's
  #1188) fails it;
- batch vs step: the cache after --spec holds the cells the one-token path writes, bit
  for bit: the references multiply a window's rows one at a time and attend each query
  alone (product_ref, attend_ref), so no row's sums depend on the rows beside it. The
  fault leaves the window's cells out of the host copy (26-30% of the bytes differ);
- QSA's key sketch holds what the one-token path writes once the next window has written
  over a rejected tail: checked on a cache of its own, with a rejected K far from the
  others.

The default model continues the bundled document (150 tokens of it, raw), 96 tokens. The
default tier runs the window in #1188's setting for 16 tokens (the negative control's test,
which checks both ways); the full tier every format for the 96.
Windows of 5 cross block boundaries (every 64 cells) and, streamed with a ring of 64
cells, the cells a window writes leave the ring and are read back from the host copy.
"""
import re
from importlib import resources

import numpy as np
import pytest

from strata_nb import Engine
from strata_nb.engine.draft import Drafter, WindowWidth, prompt_lookup
from strata_nb.errors import SettingError
from strata_nb.kv.cache import KVCache
from strata_nb.kv.plan import StreamPlan
from strata_nb.kv_layout import BLOCK
from strata_nb.probes import mirror_mismatches
from strata_nb.settings import SamplingSettings

N_PROMPT, N_NEW, WINDOW = 150, 96, 5
STREAMED = dict(kv_resident=StreamPlan.minimum_cells(64), kv_window=64)


def test_prompt_lookup_takes_the_longest_suffix_seen_before():
    history = [1, 2, 3, 4, 9, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert prompt_lookup(history, 3, 3) == [5, 6, 1]  # "2 3 4" seen twice: the latest, 3 tokens follow it
    assert prompt_lookup(history + [5, 6, 1, 2, 3, 4], 3, 3) == [5, 6, 1]
    assert prompt_lookup([7, 8, 9, 7], 4, 3) == [8, 9, 7]  # only "7" recurs: what followed it, up to the end
    assert prompt_lookup([5, 5, 5, 5], 2, 3) == [5, 5]  # a run: an occurrence 2 tokens follow, not the overlap
    assert prompt_lookup([1, 2, 3], 3, 3) == [] and prompt_lookup([1], 3, 3) == []
    assert prompt_lookup([7, 8, 9, 7], 4, 3, min_ngram=2) == []  # "7" alone is too short a match
    assert prompt_lookup(history, 3, 3, min_ngram=3) == [5, 6, 1]



def test_the_drafter_s_index_drafts_what_prompt_lookup_does():
    """Drafter finds prompt_lookup's drafts through an n-gram index as the history grows:
    random histories over a small alphabet (many repeats), every prefix, every length."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        history = [int(t) for t in rng.integers(0, 2 + trial % 5, size=60)]
        max_ngram = 1 + trial % 4
        min_ngram = 1 + trial % max_ngram
        drafter = Drafter(history[:5], max_ngram, min_ngram)
        for end in range(5, len(history) + 1):
            for n_draft in (1, 3, 7):
                want = prompt_lookup(history[:end], n_draft, max_ngram, min_ngram)
                assert drafter.draft(n_draft) == want, (trial, end)
            drafter.extend(history[end:end + 1])



def test_the_window_widens_while_its_drafts_are_kept_and_narrows_when_not():
    width = WindowWidth(8)
    assert width.widths == [2, 4, 8] and width.now == 8
    width.after(3)  # 3 of 7 kept: fewer than half
    assert width.now == 4
    width.after(1)  # 1 of 3: fewer than half
    assert width.now == 2
    width.after(0)
    assert width.now == 2  # the narrowest stays
    width.after(1)  # all kept
    assert width.now == 4
    width.after(2)  # 2 of 3: neither
    assert width.now == 4
    width.after(3)
    assert width.now == 8
    width.after(7)
    assert width.now == 8  # the widest stays
    assert WindowWidth(5).widths == [2, 4, 5] and WindowWidth(2).widths == [2]


@pytest.fixture(scope="module")
def prompt(default_model_path):
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    return Engine.load(model=default_model_path, device="cpu", max_context=512).tokenize(text)[:N_PROMPT]


def run(path, prompt, spec, n_new=N_NEW, **settings):
    """The greedy tokens, the engine, and the verify windows' (pos, length)."""
    eng = Engine.load(model=path, device="cpu", max_context=512, spec=spec, **settings)
    windows, verify = [], eng.verify
    eng.verify = lambda window, pos: windows.append((pos, len(window))) or verify(window, pos)
    tokens = []
    list(eng.generate_ids(prompt, SamplingSettings(max_tokens=n_new), on_token=tokens.append))
    return tokens, eng, windows


def differing_share(a, b, end: int) -> float:
    """The share of the bytes of cells [0, end) that differ between two snapshots."""
    differ = total = 0
    for la, lb in zip(a["layers"], b["layers"]):
        for f in la.keys() - {"sketch"}:
            x, y = (s[f].swapaxes(1, 2) for s in (la, lb))  # (blocks, BLOCK, n_kv, per_head)
            x, y = (s.reshape(-1, *s.shape[2:])[:end].view(np.uint8) for s in (x, y))
            differ, total = differ + int((x != y).sum()), total + x.size
    return differ / total


CONFIGS = [
    pytest.param("fp16", {}, id="fp16", marks=pytest.mark.slow),
    pytest.param("k8v4", STREAMED | dict(qsa_budget=128), id="k8v4-streamed-qsa", marks=pytest.mark.slow),
    pytest.param("int8", {}, id="int8", marks=pytest.mark.slow),
    pytest.param("q4_0", {}, id="q4_0", marks=pytest.mark.slow),
    pytest.param("k8v4", {}, id="k8v4", marks=pytest.mark.slow),
    pytest.param("k8v4", STREAMED, id="k8v4-streamed", marks=pytest.mark.slow),
    pytest.param("fp16", STREAMED | dict(qsa_budget=128), id="fp16-streamed-qsa", marks=pytest.mark.slow),
    pytest.param("q4_0", STREAMED, id="q4_0-streamed", marks=pytest.mark.slow),
]


@pytest.mark.model
@pytest.mark.parametrize("kv, settings", CONFIGS)
def test_spec_is_token_identical_and_writes_the_same_cache(kv, settings, default_model_path, prompt):
    want, step_eng, _ = run(default_model_path, prompt, 0, kv=kv, **settings)
    got, eng, windows = run(default_model_path, prompt, WINDOW, kv=kv, **settings)
    assert got == want
    counts = eng.last_stats.extra["spec"]
    assert counts["drafts_accepted"] > 0 and counts["passes"] < len(got)
    assert counts["drafts_accepted"] < counts["drafts_offered"]  # some drafts were rejected and written over
    assert any(pos // BLOCK != (pos + n - 1) // BLOCK for pos, n in windows)  # a window crossed a block boundary
    end = N_PROMPT + len(got) - 1
    spec_cells, step_cells = eng.kv.snapshot(end), step_eng.kv.snapshot(end)
    assert differing_share(spec_cells, step_cells, end) == 0
    if eng.kv.streamed:
        assert mirror_mismatches(eng.kv, end) == 0


@pytest.mark.model
def test_negative_control_verify_no_mirror_fails_the_parity_tests(default_model_path, prompt):
    """#1188's setting (k8v4, streamed, QSA) for the first windows: with the one writer
    the window's cells are in VRAM and the host copy alike, and the cells the one-token
    path writes; with the fault the window's cells never reach the host copy, and both
    checks fail. (The full tier decodes the whole text in every format, where the cells
    also leave the ring and are read back.)"""
    settings = dict(kv="k8v4", **STREAMED, qsa_budget=128, n_new=16)
    want, step_eng, _ = run(default_model_path, prompt, 0, **settings)
    end = N_PROMPT + len(want) - 1
    got, eng, windows = run(default_model_path, prompt, WINDOW, **settings)
    assert got == want and windows
    assert mirror_mismatches(eng.kv, end) == 0
    assert differing_share(eng.kv.snapshot(end), step_eng.kv.snapshot(end), end) == 0
    _, faulty, _ = run(default_model_path, prompt, WINDOW, fault="verify-no-mirror", **settings)
    assert mirror_mismatches(faulty.kv, end) > 0
    assert differing_share(faulty.kv.snapshot(end), step_eng.kv.snapshot(end), end) > 0


@pytest.mark.parametrize("fmt", ["fp16", "q4_0", "k8v4"])
def test_a_rejected_cell_s_sketch_is_written_over(fmt, tiny_model):
    """Cells 70..74 in one window, the last two rejected (one of them far from every other
    K), then the next window at 73..77: the key sketch is then the sketch of a cache that
    appended 70..77 alone, bit for bit. Before the second window the rejected cell's sketch
    is there (the negative control), in the block of the next query, which selection
    always reads and never scores."""
    from strata_nb.backend.numpy_backend import NumpyBackend
    from strata_nb.model.gguf_file import GGUFModel
    from strata_nb.settings import Settings

    cfg = GGUFModel(tiny_model).config
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((78, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32) for _ in range(2))
    rejected = k[70:75].copy()
    rejected[3] = 50.0  # a rejected draft's K, far from the others

    def cache(*windows):
        kv = KVCache(NumpyBackend(), cfg, Settings(model=tiny_model, kv=fmt, qsa_budget=64, max_context=256))
        kv.append(0, np.arange(70, dtype=np.int32), k[:70], v[:70], prompt=True)
        for first, keys, keep in windows:
            kv.open_window()
            kv.append(0, np.arange(first, first + len(keys), dtype=np.int32), keys, v[first:first + len(keys)],
                      prompt=False)
            kv.keep(keep)
        return kv.layers[0].sketch

    want = cache((70, k[70:78], 8))
    got = cache((70, rejected, 3), (73, k[73:78], 5))
    assert got.tobytes() == want.tobytes()
    stale = cache((70, rejected, 3))
    assert stale[73 // BLOCK, :, 73 % BLOCK].tobytes() != want[73 // BLOCK, :, 73 % BLOCK].tobytes()
    assert 73 // BLOCK == 72 // BLOCK  # the rejected cells lie in the block of the next query (at 73)


def test_spec_settings_are_checked(tiny_model):
    for spec, message in ((1, "must be 0 (off) or a window of 2 .. 8 positions, got 1"), (9, "got 9")):
        with pytest.raises(SettingError, match=re.escape(message)):
            Engine.load(model=tiny_model, device="cpu", spec=spec)
    with pytest.raises(SettingError, match="'verify-no-mirror' breaks the verify window's host copy: it needs --spec"):
        Engine.load(model=tiny_model, device="cpu", spec=4, fault="verify-no-mirror")
    eng = Engine.load(model=tiny_model, device="cpu", spec=4)
    with pytest.raises(SettingError, match="verifies greedy picks: it needs --temperature 0"):
        list(eng.generate("hi", temperature=0.5))


def test_a_reply_that_repeats_one_token_stops(tiny_model):
    """The tiny random model's greedy reply is one byte over and over: stopped at 256."""
    eng = Engine.load(model=tiny_model, device="cpu", max_context=512)
    tokens = []
    list(eng.generate_ids(eng.tokenize("abc"), SamplingSettings(max_tokens=400), on_token=tokens.append))
    assert eng.last_stats.finish_reason == "repetition"
    assert len(tokens) == 256 and len(set(tokens)) == 1


def test_run_stats_print_the_speculation_line(tiny_model, capsys):
    from strata_nb.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "abcabcabc", "--model", tiny_model, "--device", "cpu", "--raw", "--max-tokens", "20",
              "--spec", "4", "--stats"])
    err = capsys.readouterr().err
    assert exit_.value.code == 0 and "speculation: window 4," in err and "drafts accepted" in err
    with pytest.raises(SystemExit) as exit_:
        main(["run", "abc", "--model", tiny_model, "--device", "cpu", "--spec", "9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == ["strata-nb: error: --spec must be 0 (off) or a window of 2 .. 8 "
                                             "positions, got 9"]

