"""`strata-nb bench` on the CPU (numpy backend, tiny model): its files, its output check,
--append, and bad input. The GPU numbers come from the same command on the H200."""
import json

import numpy as np
import pytest

from strata_nb.bench.check import GAP_TOL, LAYER0_TOL, check_tokens, reference_spread
from strata_nb.bench.report import table, write
from strata_nb.cli import main
from cli_runner import run_cli


def bench_argv(model, out, *more):
    return ["bench", "--model", model, "--device", "cpu", "--max-context", "512", "--runs", "2",
            "--decode-tokens", "4", "--no-peer", "--out", str(out), *more]


def test_bench_writes_json_table_and_checks_every_row(tiny_model, tmp_path, capsys):
    code, out, err = run_cli(bench_argv(tiny_model, tmp_path, "--depths", "40", "--formats", "fp16,k8v4",
                                        "--streamed-formats", "k8v4"), capsys)
    assert code == 0, err
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = result["rows"]
    assert [(r["fmt"], r["mode"].split()[0]) for r in rows] == [("fp16", "resident"), ("k8v4", "resident"),
                                                                 ("k8v4", "streamed")]
    for r in rows:
        assert len(r["prefill_runs"]) == len(r["decode_runs"]) == 2 and r["decode_tok_s"] > 0
        assert r["check"]["tokens"] == 7 and not r["check"]["broken"]  # the prefill's pick, 2 warm-up, 4 timed
        # numpy against numpy in another process (its BLAS threads differ): a rare rounding tie at most
        assert r["check"]["layer0"] < 0.1 * LAYER0_TOL
        assert len(r["tokens"]) == 7
    assert rows[2]["hit_rate"] is not None and rows[0]["hit_rate"] is None
    assert result["dependent_launches"] == "no GPU"  # fast/dependent_launch.py: a cuda backend's word
    md = (tmp_path / "bench.md").read_text()
    assert "| configuration | depth |" in md and "strata-nb bench --model" in md and "ok: " in md
    assert "dependent launches" not in md


def test_an_out_folder_that_cannot_be_made_is_one_line_before_any_work(tiny_model, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    from strata_nb import cli
    monkeypatch.setattr(cli, "load_engine", lambda **kw: pytest.fail("the engine loaded before --out was checked"))
    code, out, err = run_cli(bench_argv(tiny_model, tmp_path / "a_file" / "bench"), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"--out {tmp_path / 'a_file' / 'bench'}: cannot make the folder" in err


def test_a_run_cut_short_keeps_its_measured_rows(tiny_model, tmp_path, capsys, monkeypatch):
    """bench.partial.json holds the rows measured so far, unchecked, and is gone after a
    run that finishes; a run that dies in its second configuration leaves the first row."""
    import strata_nb.bench.run as bench_run

    assert run_cli(bench_argv(tiny_model, tmp_path, "--depths", "40", "--formats", "fp16", "--streamed-formats", "",
                              "--check-tokens", "0"), capsys)[0] == 0
    assert (tmp_path / "bench.json").exists() and not (tmp_path / "bench.partial.json").exists()
    measure = bench_run.run_config

    def second_dies(base, cfg, *args):
        if cfg.fmt == "int8":
            raise RuntimeError("stopped")  # as a run cut short by its time limit
        return measure(base, cfg, *args)
    monkeypatch.setattr(bench_run, "run_config", second_dies)
    with pytest.raises(RuntimeError, match="stopped"):
        main(bench_argv(tiny_model, tmp_path / "cut", "--depths", "40", "--formats", "fp16,int8",
                        "--streamed-formats", "", "--check-tokens", "0"))
    partial = json.loads((tmp_path / "cut" / "bench.partial.json").read_text())
    assert [r["fmt"] for r in partial["rows"]] == ["fp16"] and partial["rows"][0]["decode_tok_s"] > 0
    assert partial["command"].startswith("strata-nb bench") and not (tmp_path / "cut" / "bench.json").exists()


def test_append_adds_rows(tiny_model, tmp_path, capsys):
    assert run_cli(bench_argv(tiny_model, tmp_path, "--depths", "40", "--formats", "fp16", "--streamed-formats", ""), capsys)[0] == 0
    assert run_cli(bench_argv(tiny_model, tmp_path, "--depths", "40", "--formats", "int8", "--streamed-formats", "",
                              "--check-tokens", "0", "--append"), capsys)[0] == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [r["fmt"] for r in result["rows"]] == ["fp16", "int8"]
    assert result["rows"][1]["check"] is None and "; then: " in result["command"]
    assert "not checked" in (tmp_path / "bench.md").read_text()


def test_check_marks_a_far_token_broken():
    logits = np.zeros((3, 10), np.float32)
    logits[:, 4] = 5.0  # numpy's pick is 4 everywhere
    logits[:, 7] = 5.0 - GAP_TOL / 2  # a near tie
    ok = check_tokens(logits, [4, 7, 4])
    assert (ok.exact, ok.broken) == (2, False) and ok.max_gap == pytest.approx(GAP_TOL / 2)
    bad = check_tokens(logits, [4, 4, 2])  # token 2 is 5 logits below the top
    assert bad.broken and bad.max_gap == pytest.approx(5.0)


def test_the_reference_spread_widens_the_tolerance_by_what_it_measured():
    logits = np.zeros((2, 10), np.float32)
    logits[:, 4] = 5.0
    logits[:, 7] = 5.0 - 1.5 * GAP_TOL  # a token 1.5 GAP_TOL down: broken on its own
    alt = logits.copy()
    alt[1, 7] = 5.0 - 0.9 * GAP_TOL  # the other reference puts it only 0.9 GAP_TOL down
    spread = reference_spread(logits, alt, [4, 7])
    assert spread == pytest.approx(0.6 * GAP_TOL)
    assert check_tokens(logits, [4, 7]).broken
    assert not check_tokens(logits, [4, 7], spread).broken  # within GAP_TOL + spread
    far = np.zeros((2, 10), np.float32)
    far[:, 4] = 5.0  # token 2 is 5 logits down: no rounding spread of 0.6 excuses it
    assert check_tokens(far, [4, 2], spread).broken


def test_a_failing_check_measures_the_spread_and_still_fails_a_far_token(tiny_model, monkeypatch):
    """check_job's second reference (another prefill chunk) runs when a gap exceeds
    GAP_TOL; on a fp32 cache its spread is near 0, so a token the model puts far down stays
    broken, and the spread is reported."""
    from strata_nb.bench import check
    from strata_nb.bench.check import check_job, reference_logits
    from strata_nb.engine.engine import Engine

    monkeypatch.setattr(check, "_ENGINE", None)  # a worker's engine, built on its first job: this test's

    base = dict(model=tiny_model, kv="fp32", max_context=128, prefill_chunk=16)
    prompt = list(range(3, 40))
    eng = Engine.load(device="cpu", **base)
    first = eng.derive().prefill(prompt)
    worst = int(np.argmin(first))
    tokens = [worst, int(np.argmax(first))]
    c = check_job(base, {}, prompt, tokens)
    assert c["broken"] and c["spread"] is not None and c["spread"] < 0.1
    assert c["max_gap"] == pytest.approx(float(first.max() - first.min()), abs=1e-4)
    good = [int(np.argmax(r)) for r in reference_logits(eng.derive(), prompt, tokens)][:1]
    assert check_job(base, {}, prompt, good)["spread"] is None  # nothing to excuse: not measured


def test_layer0_bytes_catch_a_dropped_mirror_write_whatever_the_tokens(tiny_model, monkeypatch):
    """The class of Strata #1188: --fault drop-v-mirror never writes the V half of the host
    copy. A streamed row's layer-0 prompt bytes are then far from the reference's, so the
    row is broken even where its tokens pass; a clean run's bytes are the reference's."""
    from strata_nb.bench import check
    from strata_nb.bench.check import check_job
    from strata_nb.bench.run import Config
    from strata_nb.engine.engine import Engine

    monkeypatch.setattr(check, "_ENGINE", None)
    base = dict(model=tiny_model, kv="fp16", max_context=512, prefill_chunk=128)
    prompt = [3 + (7 * i) % 90 for i in range(400)]  # past the 320 resident cells: blocks only in the host copy
    streamed = Config("k8v4", True, len(prompt)).settings(Engine.load(device="cpu", **base).settings.kv_window)
    for fault, broken in (("none", False), ("drop-v-mirror", True)):
        eng = Engine.load(device="cpu", fault=fault, **(base | streamed))
        assert eng.kv.streamed
        tokens = [int(np.argmax(eng.prefill(prompt)))]  # the prefill's pick: it reads the stage, not the host copy
        layer0 = eng.kv.snapshot(len(prompt), [0])["layers"][0]
        c = check_job(base, streamed, prompt, tokens, layer0)
        assert c["broken"] == broken and (c["layer0"] > 0.5 if broken else c["layer0"] < 0.1 * LAYER0_TOL), (fault, c)
        assert c["max_gap"] <= GAP_TOL and LAYER0_TOL < 0.5  # the tokens alone would pass


def test_a_broken_row_cannot_look_like_a_win():
    row = dict(fmt="k8v4", mode="resident", depth=1024, prefill_tok_s=9e9, decode_tok_s=9e9, kv_bytes=0,
               bytes_per_token=0, gb_s=0.0, hit_rate=None, graph=True,
               check=dict(tokens=32, exact=3, max_gap=7.5, broken=True))
    md = table({"rows": [row], "copy_gb_s": None})
    assert "~~k8v4 resident~~" in md and "**BROKEN**" in md


def test_a_degenerate_or_non_identical_row_is_flagged():
    """A free run stuck in a loop (loop score above DEGENERATE), or a --spec row whose
    tokens are not --spec 0's, is struck through like a broken one. A run that repeats
    a long passage scores high on repetition, and is not a loop."""
    from strata_nb.probes import DEGENERATE, loop_score, repetition_score

    loop, prose, passage = [5, 6, 7, 8] * 16, list(range(64)), list(range(30)) * 2
    assert loop_score(loop) > DEGENERATE > loop_score(prose) == repetition_score(prose) == 0.0
    assert repetition_score(passage) > 0.4 and loop_score(passage) == 0.0
    ok = dict(tokens=8, exact=8, max_gap=0.0, broken=False)
    row = dict(fmt="fp16", mode="resident", depth=64, prefill_tok_s=1.0, decode_tok_s=1.0, kv_bytes=0,
               bytes_per_token=0, gb_s=0.0, hit_rate=None, graph=False, check=ok)
    looping = row | dict(loop=loop_score(loop))
    md = table({"rows": [row | dict(loop=0.1), looping], "copy_gb_s": None})
    assert md.count("~~fp16 resident~~") == 1 and "**DEGENERATE**: loop score 0.93" in md
    spec = dict(passes=3, drafts_offered=9, drafts_accepted=4, tokens_per_pass=2.0)
    md = table({"rows": [row | dict(mode="resident, spec 4", spec=spec | dict(identical=False))], "copy_gb_s": None})
    assert "~~fp16 resident, spec 4~~" in md and "**NOT the spec 0 tokens**" in md and "4/9 drafts accepted" in md


def test_spec_rows_report_acceptance_and_keep_the_one_token_rows_tokens(tiny_model, tmp_path, capsys):
    code, out, err = run_cli(bench_argv(tiny_model, tmp_path, "--depths", "40", "--formats", "fp16",
                                        "--streamed-formats", "", "--spec", "4"), capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["resident", "resident, spec 4"]
    spec = rows[1]["spec"]
    assert spec["identical"] and rows[1]["tokens"] == rows[0]["tokens"] and not rows[1]["check"]["broken"]
    assert spec["window"] == 4 and spec["passes"] >= 1 and 0 <= spec["drafts_accepted"] <= spec["drafts_offered"]
    assert spec["tokens_per_pass"] == 4 / spec["passes"] and "drafts accepted" in (tmp_path / "bench.md").read_text()


def test_the_profile_decodes_after_a_prompt_of_at_least_one_token():
    """It starts 4 * STEPS positions before the last depth, so the profiled steps fit the
    context; a bench at depth 1 (llama-bench's tg: from an empty context) profiled after an
    empty prompt, and the prefill of no tokens failed with an IndexError."""
    from strata_nb.bench.profile import STEPS
    from strata_nb.bench.run import profile_depth

    assert profile_depth(8157) == 8157 - 4 * STEPS
    assert profile_depth(1) == profile_depth(4 * STEPS) == 1


def test_a_prefill_of_no_tokens_is_a_clear_error(tiny_model):
    from strata_nb.engine.engine import Engine
    from strata_nb.errors import StrataError

    with pytest.raises(StrataError, match="at least one token"):
        Engine.load(model=tiny_model, device="cpu").prefill([])


def test_the_report_has_a_section_per_profiled_step(tmp_path):
    """The bench profiles a resident step and, with streamed rows, a streamed one (on a GPU,
    with torch); the markdown gets a per-kernel table for each."""
    def prof(kernels):
        return dict(kernels=kernels, gpu_us=sum(us for _, us in kernels.values()), graph_wall_us=2600.0,
                    eager_wall_us=9e4, launches=sum(n for n, _ in kernels.values()), prefill_chunk=16,
                    prefill_kernels={"matmul_kernel": (30, 900.0)}, prefill_gpu_us=900.0)
    result = {"rows": [], "copy_gb_s": None, "command": "strata-nb bench", "model": "m", "device": "d", "runs": 5,
              "decode_tokens": 32,
              "profile": prof({"attention_step_kernel": (30, 980.0)}) | {"config": "k8v4 resident at 8000"},
              "profile_streamed": prof({"select_blocks_kernel": (30, 268.3), "attention_step_kernel": (30, 895.5)})
              | {"config": "k8v4 streamed at 8000"}}
    write(result | {"dependent_launches": "on"}, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "decode tokens per run: 32; dependent launches: on." in md
    assert "## One decode step, k8v4 resident at 8000" in md and "## One decode step, k8v4 streamed at 8000" in md
    assert "| `select_blocks_kernel` | 30 | 268.3 | 23.1% |" in md


@pytest.mark.parametrize("more, message", [
    (["--formats", "bogus"], "--formats takes formats from"),
    (["--depths", "x"], "--depths takes comma-separated token counts"),
    (["--depths", "600"], "do not fit --max-context 512"),
    (["--runs", "0"], "--runs and --decode-tokens must be >= 1"),
    (["--append"], "--append needs a readable bench.json"),
    (["--max-context", "256"], "streamed rows need --max-context above the minimum resident size"),
    (["--expert-cache", "50%"], "--expert-cache benches an MoE model's expert cache; this model is dense"),
    (["--expert-cache", "half"], "--expert-cache takes shares of the experts from 0% to 100%"),
    (["--expert-cache", "150%"], "--expert-cache takes shares of the experts from 0% to 100%"),
    (["--spec", "9"], "--spec takes verify windows from 2 to 8"),
    (["--spec", "four"], "--spec takes verify windows from 2 to 8"),
])
def test_bad_input_is_one_line_and_exit_2(more, message, tiny_model, tmp_path, capsys):
    argv = bench_argv(tiny_model, tmp_path / "empty", "--formats", "fp16", "--check-tokens", "0")
    argv += ["--depths", "40"] if "--depths" not in more else []
    code, out, err = run_cli(argv + more, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_moe_rows_at_each_cache_share_report_the_expert_hit_rate(tiny_model, tmp_path, capsys):
    """An MoE model (moefy's copies of the tiny model): the resident row, then one per
    share of the experts cached; their tokens are the all-resident row's, and the check
    passes for each."""
    from strata_nb.model.moefy import moefy

    moe = str(moefy(tiny_model, tmp_path / "copies.gguf", "copies", 4, used=2, seed=1))
    code, out, err = run_cli(bench_argv(moe, tmp_path / "out", "--depths", "40", "--formats", "fp16",
                                        "--streamed-formats", "", "--expert-cache", "25%,100%"), capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["resident", "resident, experts 2/8 cached", "resident, experts 8/8 cached"]
    assert rows[0]["experts"]["hit_rate"] == rows[2]["experts"]["hit_rate"] == 1.0
    assert rows[1]["experts"]["slots"] == 2 and rows[1]["experts"]["hit_rate"] < 1.0
    assert rows[1]["tokens"] == rows[0]["tokens"] == rows[2]["tokens"]
    assert all(not r["check"]["broken"] for r in rows)
    assert "experts 1.000" in (tmp_path / "out" / "bench.md").read_text()


def test_the_recorded_command_is_written_as_a_reader_pastes_it():
    """bench.md and the README name the model by its file and drop the machine's paths."""
    from strata_nb.bench.report import model_file, pastable

    ran = ("strata-nb bench --model /tmp/home/SmolLM2-135M-Instruct.Q4_1.gguf --depths 1,8192 --out /root/out/b "
           "--llama-bench /tmp/ll/llama.cpp/build/bin/llama-bench")
    assert pastable(ran) == "strata-nb bench --depths 1,8192 --llama-bench llama.cpp/build/bin/llama-bench"
    assert model_file(ran) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    other = "strata-nb bench --model=/tmp/m/shapes.gguf --out=/x; then: strata-nb bench --model /tmp/m/shapes.gguf --append"
    assert pastable(other) == "strata-nb bench --model shapes.gguf; then: strata-nb bench --model shapes.gguf --append"
    assert model_file(other) == "shapes.gguf"
