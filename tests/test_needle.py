"""The retrieval probe (`strata-nb needle`): its text, its cases, a small real run, the CLI."""
import json
import re
import sys
from importlib.util import find_spec

import numpy as np
import pytest

from strata_nb import needle
from strata_nb.errors import StrataError
from strata_nb.needle_text import Fact, fact, filler, sentences
from cli_runner import run_cli


def words(text: str) -> int:
    return len(text.split())


def test_filler_has_no_digit_and_is_deterministic():
    a = filler(np.random.default_rng(7), 3000, words)
    assert a == filler(np.random.default_rng(7), 3000, words)
    assert a != filler(np.random.default_rng(8), 3000, words)
    text = "\n\n".join(a)
    assert not re.search(r"\d", text)  # a number in the reply can only come from the fact
    assert sum(words(p) for p in a) >= 3000 > sum(words(p) for p in a[:-1])  # reaches it, no further
    assert all(4 <= len(sentences(p)) <= 8 for p in a)
    # the facts' key words are not in the filler: a name in a reply came from the fact
    rng = np.random.default_rng(0)
    for f in (fact(rng) for _ in range(40)):
        assert f.answer.lower() not in text.lower() and f.answer not in f.question


def test_fact_found():
    code = Fact("The code of the red locker is 8566.", "What is the code of the red locker?", "8566")
    assert code.found("The code of the red locker is 8566.")
    assert code.found("It is 8 5 6 6") and code.found("8-566") and code.found("8,566")
    assert not code.found("The code of the red locker is 856.") and not code.found("6658")
    name = Fact("The owl at the lighthouse is called Juniper.", "What is the owl called?", "Juniper")
    assert name.found("The owl at the lighthouse is called JUNIPER.") and not name.found("It is called Jun")


@pytest.mark.model
@pytest.mark.parametrize("length", [200, 1000, 2037])
def test_build_case_fills_the_length_and_places_the_fact(length, engine_for):
    eng = engine_for("fp16", max_context=4096)
    prompts = set()
    for depth in (0.0, 0.3, 0.7, 1.0):
        ids, planted = needle.build_case(eng, length, depth, seed=11)
        assert (ids, planted) == needle.build_case(eng, length, depth, seed=11)  # deterministic
        assert length - 32 <= len(ids) <= length  # short of it by less than a filler sentence (< 30 tokens)
        text = eng.tokenizer.decode(ids)
        body = text[text.index("user\n") + 5:text.index("<|im_end|>", text.index("user\n"))]
        assert body.endswith("\n\n" + planted.question) and body.count(planted.text) == 1
        before, after = body[:-len(planted.question)].split(planted.text)
        assert before == "" or before.endswith("\n\n")  # a paragraph of its own
        assert after.startswith("\n\n")
        # at the requested share of the filler, within half a paragraph (the fact goes in a gap)
        paragraphs = [p for p in (before + after).split("\n\n") if p]
        half = max(map(len, paragraphs)) / 2 / sum(map(len, paragraphs))
        assert abs(len(before) / len(before + after) - depth) <= half + 0.01
        if depth in (0.0, 1.0):
            assert body.startswith(planted.text) if depth == 0.0 else after == "\n\n"
        prompts.add(tuple(ids))
    # each depth its own gap between paragraphs, where there are enough (200 tokens hold ~2)
    assert len(prompts) == 4 if length >= 1000 else len(prompts) >= 2
    assert needle.build_case(eng, length, 0.5, seed=12)[0] != needle.build_case(eng, length, 0.5, seed=11)[0]


# Measured on the numpy backend: with seed 0 the default model names both facts at full
# attention. QSA 128 is less than block 0 and the 256-cell window, so a decode query reads
# those alone, whatever the blocks score: the fact at depth 0.8 is in the window, the one at
# 0.2 is not, and its reply goes wrong (with other seeds the dense prompt pass has carried the
# fact into the window's cells, and the reply still names it: a miss is not certain).
@pytest.fixture(scope="module")
def small_run(engine_for):
    eng = engine_for("fp16", max_context=512)
    ticks = []
    result = needle.run(eng, [384], [0.8, 0.2], [128, 0], trials=1, max_tokens=16, progress=ticks.append, seed=0)
    assert ticks == [1] * 4
    return result


@pytest.mark.model
def test_run_full_attention_finds_the_facts(small_run):
    r = small_run
    assert (r["lengths"], r["depths"], r["budgets"], r["trials"]) == ([384], [0.2, 0.8], [0, 128], 1)
    assert set(r["accuracy"]) == {"0", "128"}
    assert all(set(r["accuracy"][b]) == {"384"} and set(r["accuracy"][b]["384"]) == {"0.2", "0.8"}
               for b in ("0", "128"))
    assert r["settings"]["backend"] == "numpy" and r["settings"]["kv"] == "fp16"
    assert len(r["cases"]) == 2 and len({c["fact"] for c in r["cases"]}) == 2  # a fact of its own each
    for c in r["cases"]:
        assert c["prompt_tokens"] <= 384 - 16  # the prompt leaves room for the reply
        assert 0 < c["fact_cell"] < c["prompt_tokens"]
        for b in ("0", "128"):
            assert c["found"][b] == Fact(c["fact"], c["question"], c["answer"]).found(c["replies"][b])
        assert c["found"]["0"], c["replies"]
    assert r["accuracy"]["0"]["384"] == {"0.2": 1.0, "0.8": 1.0} and r["overall"]["0"] == 1.0
    # the negative control: the probe reports a fact the budget did not read
    early, late = r["cases"]
    def window_start(pos):  # the window's first block for a query at pos: 16 blocks of 16 cells
        return pos // 16 - 15

    assert early["fact_cell"] // 16 < window_start(early["prompt_tokens"])  # out of it at every step
    assert late["fact_cell"] // 16 >= window_start(late["prompt_tokens"] + 15)  # in it at every step
    assert r["accuracy"]["128"]["384"] == {"0.2": 0.0, "0.8": 1.0} and r["overall"]["128"] == 0.5


@pytest.mark.model
def test_table(small_run):
    again = json.loads(json.dumps(small_run))  # the outputs redraw from needle.json
    lines = needle.table(again).splitlines()
    assert lines[0] == "| attention | length | depth 0.2 | depth 0.8 | all depths | of full |"
    assert lines[2] == "| full attention | 384 | 1.00 | 1.00 | 1.00 | - |"
    assert lines[-1] == "| QSA 128 | all | 0.00 | 1.00 | 0.50 | 50% |"


@pytest.mark.model
def test_heatmap(small_run, tmp_path):
    pytest.importorskip("matplotlib", reason="the heat map needs the bench extra")
    png = needle.heatmap(json.loads(json.dumps(small_run)), tmp_path / "needle.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_heatmap_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(StrataError, match=r"pip install 'strata-nb\[bench\]'"):
        needle.heatmap({}, tmp_path / "needle.png")


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "512", "--max-context", "256"], "--lengths 512 does not fit the engine's max_context of 256 cells"),
    (["--lengths", "140"], "--lengths 140 leaves 124 prompt tokens beside the reply's 16"),
    (["--lengths", "2k"], "--lengths takes comma-separated token counts, got '2k'"),
    (["--depths", "0.5,1.5"], "--depths must lie in [0, 1]"),
    (["--depths", "nan"], "--depths must lie in [0, 1]"),
    (["--depths", ""], "--depths must name at least one value"),
    (["--budgets=0,-64"], "--budgets must be 0 (full attention) or positive cell counts, got -64"),
    (["--budgets", "512,all"], "--budgets takes comma-separated cell counts"),
    (["--trials", "0"], "--trials must be at least 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, tiny_model, capsys):
    code, out, err = run_cli(["needle", "--model", tiny_model, "--device", "cpu", "--lengths", "256"] + argv, capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata-nb: error:") and message in lines[0], err


def test_an_out_folder_that_cannot_be_made_is_said_before_the_replies(tiny_model, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    from strata_nb import cli
    monkeypatch.setattr(cli, "load_engine", lambda **kw: pytest.fail("the engine loaded before --out was checked"))
    code, out, err = run_cli(["needle", "--model", tiny_model, "--device", "cpu", "--lengths", "256", "--out",
                              str(tmp_path / "a_file" / "x")], capsys)
    assert code == 2 and "cannot make the folder" in err and len(err.strip().splitlines()) == 1, err


SMALL = ["--device", "cpu", "--lengths", "300,360", "--depths", "0,1", "--budgets", "32,0", "--trials", "1",
         "--max-tokens", "3"]


def test_cli_writes_json_table_and_heatmap(tiny_model, tmp_path, capsys):
    """The whole command on the tiny random-weight model: what it writes, not what it finds."""
    out = tmp_path / "needle-out"
    code, stdout, err = run_cli(["needle", "--model", tiny_model, *SMALL, "--out", str(out)], capsys)
    assert code == 0, err
    assert stdout.splitlines()[0].startswith("| attention | length | depth 0 | depth 1 |")
    assert len(stdout.splitlines()) == 2 + 2 * 3  # header, rule, and per budget two lengths and `all`
    saved = json.loads((out / "needle.json").read_text())
    assert saved["command"].startswith("strata-nb needle --model")
    assert len(saved["cases"]) == 4 and all(set(c["replies"]) == {"0", "32"} for c in saved["cases"])
    assert saved["settings"]["device"] == "CPU (numpy backend)"
    assert needle.table(saved) in (out / "needle.md").read_text()
    if find_spec("matplotlib") is not None:  # the bench extra
        assert (out / "needle.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_without_matplotlib_writes_the_rest(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, stdout, err = run_cli(["needle", "--model", tiny_model, *SMALL, "--json", "--out", str(tmp_path)], capsys)
    assert code == 0 and "needle.png needs matplotlib (pip install 'strata-nb[bench]')" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["needle.json", "needle.md"]
    assert json.loads(stdout) == json.loads((tmp_path / "needle.json").read_text())


@pytest.mark.model
def test_qsa_selects_the_fact_s_blocks(engine_for, monkeypatch):
    """Selection reads the blocks that hold a fact far outside the window more often than a
    random choice would: the key sketch scores them high (docs/walkthrough/select.md).
    Window 4 blocks, budget 8: block 0, the window and the best 3 of about 17 others."""
    from math import comb

    from strata_nb.kv import cache as kv_cache
    from strata_nb.kv_layout import BLOCK
    from strata_nb.settings import SamplingSettings

    eng = engine_for("fp16", max_context=512, kv_window=64, qsa_budget=128)
    ids, planted = needle.build_case(eng, 368, 0.2, seed=0)
    start = needle.first_index(ids, eng.tokenize(planted.text))
    words = len(eng.tokenize(planted.text))
    fact_blocks = set(range(start // BLOCK, (start + words - 1) // BLOCK + 1))
    rows, select = [], kv_cache.KVCache.select
    monkeypatch.setattr(kv_cache.KVCache, "select", lambda self, L, q, p: rows.append(select(self, L, q, p)) or rows[-1])
    reply = "".join(eng.generate_ids(ids, SamplingSettings(max_tokens=16)))
    assert planted.found(reply), reply
    n_others = len(ids) // BLOCK - 4  # candidates: not block 0, not the window (its 4 blocks)
    chance = 1 - comb(n_others - len(fact_blocks), 3) / comb(n_others, 3)  # a random 3 of them hold a fact block
    hit = np.mean([bool(fact_blocks & set(r[0].tolist())) for r in rows])
    assert hit >= 1.5 * chance, (hit, chance)  # measured: 0.61 against a chance of about 0.33
