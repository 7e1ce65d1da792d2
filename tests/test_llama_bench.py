"""`strata-nb bench --llama-bench PATH`, with a stand-in for llama.cpp's llama-bench: a
script that answers the arguments it is given as llama-bench's JSON does (prompt
processing of each -p, generation of -n tokens at each -d), so the rows, their pairing
with ours and the ratios are checked without llama.cpp. The stand-in also records each
command line, so the KV types sent for each format are checked. A real llama-bench's
output (tests/fixtures/llama_bench_output.json) is replayed too."""
import json
import stat
import statistics
import sys
from pathlib import Path

import pytest

from strata_nb.bench.llama import KV_TYPES, llama_rows, ratios
from strata_nb.bench.report import llama_table, table
from cli_runner import run_cli

FAKE = '''#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {fail!r}:
    sys.stderr.write("loading model\\nerror: unknown cache type\\n")
    sys.exit(1)
val = lambda flag: args[args.index(flag) + 1]
if {fallback!r} and val("-ctk") != val("-ctv") and "-d" in args:  # as a CUDA build without the pair's kernel
    sys.stderr.write("ggml_cuda_flash_attn_ext_vec: no FlashAttention vector kernel compiled for K/V types "
                     "q8_0-q4_0, converting K and V to f16 instead (slow).\\n")
prompts, gen = [int(x) for x in val("-p").split(",")], int(val("-n"))
depths = [int(x) for x in val("-d").split(",")] if "-d" in args else [0]
tests = []
for d in depths:
    for p in prompts:
        if p:
            tests.append(dict(n_prompt=p, n_gen=0, n_depth=d, avg_ts=1000.0, samples_ts=[900.0, 1000.0, 1100.0]))
    if gen:
        tests.append(dict(n_prompt=0, n_gen=gen, n_depth=d, avg_ts=100.0 - d / 100, samples_ts=[100.0 - d / 100]))
for t in tests:
    t.update(build_commit="abc1234", build_number=42, type_k=val("-ctk"), type_v=val("-ctv"))
print(json.dumps(tests))
'''


def executable(tmp_path, text):
    """A script at tmp_path/llama-bench that runs as a binary would."""
    path = tmp_path / "llama-bench"
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def fake(tmp_path, fail=False, fallback=False):
    log = tmp_path / "calls.jsonl"
    return executable(tmp_path, FAKE.format(python=sys.executable, log=str(log), fail=fail, fallback=fallback)), log


def test_rows_pair_prefill_and_decode_per_depth_with_the_format_s_cache_types(tmp_path):
    binary, log = fake(tmp_path)
    rows = llama_rows(binary, "m.gguf", ["fp16", "k8v4"], [64, 200], 3, 16, lambda m: None)
    assert [(r["fmt"], r["depth"]) for r in rows] == [("fp16", 64), ("fp16", 200), ("k8v4", 64), ("k8v4", 200)]
    assert rows[0]["prefill_tok_s"] == 1000.0 and rows[1]["decode_tok_s"] == 98.0  # the median; the depth's test
    assert rows[2]["peer"] == "llama.cpp K q8_0 V q4_0" and rows[0]["build"] == "abc1234 (42)"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4  # prefill and decode, per format
    for call, fmt in zip(calls, ["fp16", "fp16", "k8v4", "k8v4"]):
        assert (call[call.index("-ctk") + 1], call[call.index("-ctv") + 1]) == KV_TYPES[fmt]
        assert call[call.index("-m") + 1] == "m.gguf" and call[call.index("-r") + 1] == "3"
    assert calls[1][calls[1].index("-d") + 1] == "64,200" and calls[1][calls[1].index("-n") + 1] == "16"


def test_a_failing_binary_is_an_error_row_not_a_crash(tmp_path):
    binary, _ = fake(tmp_path, fail=True)
    said = []
    rows = llama_rows(binary, "m.gguf", ["int8"], [64], 1, 8, said.append)
    assert rows == [{"peer": "llama.cpp K q8_0 V q8_0", "fmt": "int8",
                     "error": "llama-bench exited 1: error: unknown cache type"}]
    assert "exited 1" in said[0]


def test_a_build_that_converts_the_cache_to_f16_gives_an_error_row_not_a_rate(tmp_path):
    binary, _ = fake(tmp_path, fallback=True)
    said = []
    rows = llama_rows(binary, "m.gguf", ["fp16", "k8v4"], [64], 1, 8, said.append)
    assert "error" not in rows[0] and rows[0]["decode_tok_s"] > 0  # f16-f16 has its kernel
    assert rows[1]["fmt"] == "k8v4" and "decode_tok_s" not in rows[1]
    assert "no FlashAttention kernel for K q8_0 V q4_0" in rows[1]["error"]
    assert "-DGGML_CUDA_FA_QUANTS=f16-f16,q8_0-q8_0,q4_0-q4_0,q8_0-q4_0" in rows[1]["error"]


def test_ratios_are_ours_over_llama_cpp_s_for_the_resident_rows():
    ours = [dict(fmt="fp16", mode="resident", depth=64, prefill_tok_s=500.0, decode_tok_s=200.0),
            dict(fmt="fp16", mode="streamed (min resident, QSA 1024)", depth=64, prefill_tok_s=1.0, decode_tok_s=1.0)]
    llama = [dict(peer="llama.cpp K f16 V f16", fmt="fp16", depth=64, build="b", prefill_tok_s=1000.0,
                  decode_tok_s=100.0)]
    result = {"rows": ours, "llama": llama}
    assert ratios(result) == [dict(fmt="fp16", depth=64, peer="llama.cpp K f16 V f16", prefill=0.5, decode=2.0)]
    assert "| fp16 | 64 | llama.cpp K f16 V f16 | 0.50 | 2.00 |" in llama_table(result)


def test_bench_runs_llama_bench_beside_its_rows(tiny_model, tmp_path, capsys):
    binary, _ = fake(tmp_path)
    out = tmp_path / "out"
    code, _, err = run_cli(["bench", "--model", tiny_model, "--device", "cpu", "--formats", "fp16",
                            "--streamed-formats", "", "--depths", "64", "--runs", "1", "--decode-tokens", "4",
                            "--check-tokens", "0", "--no-peer", "--no-profile", "--llama-bench", binary,
                            "--out", str(out)], capsys)
    assert code == 0, err
    result = json.loads((out / "bench.json").read_text())
    assert [(r["fmt"], r["depth"]) for r in result["llama"]] == [("fp16", 64)]
    md = (out / "bench.md").read_text()
    assert "## Against llama.cpp" in md and "| fp16 | 64 | llama.cpp K f16 V f16 |" in md
    assert "llama.cpp abc1234 (42)" in table(result)


REAL = '''#!{python}
import json, sys
args = sys.argv[1:]
recorded = json.load(open({fixture!r}))
expected = recorded["prefill_args"] if args[args.index("-n") + 1] == "0" else recorded["decode_args"]
if args[2:] != expected:  # after -m MODEL: the arguments the recording was made with
    sys.stderr.write("not the recorded arguments: " + " ".join(args) + "\\n")
    sys.exit(2)
print(json.dumps(recorded["prefill" if expected is recorded["prefill_args"] else "decode"]))
'''


def test_rows_from_a_real_llama_bench_s_output(tmp_path):
    """What a real llama-bench printed (tests/fixtures/llama_bench_output.json: its JSON for
    the two commands llama_rows sends, k8v4's cache types, depths 64 and 256) is replayed by
    a script that also checks it is sent the recorded arguments: the fields the rows read
    are where the stand-in above puts them."""
    fixture = Path(__file__).parent / "fixtures" / "llama_bench_output.json"
    recorded = json.loads(fixture.read_text())
    binary = executable(tmp_path, REAL.format(python=sys.executable, fixture=str(fixture)))
    said = []
    rows = llama_rows(binary, "m.gguf", ["k8v4"], [64, 256], 2, 8, said.append)
    assert [r.get("error") for r in rows] == [None, None], said
    for row, pp, tg in zip(rows, recorded["prefill"], recorded["decode"]):
        assert row["depth"] == pp["n_prompt"] == tg["n_depth"]
        assert row["prefill_tok_s"] == statistics.median(pp["samples_ts"])
        assert row["decode_tok_s"] == statistics.median(tg["samples_ts"])
        assert row["build"] == f"{pp['build_commit']} ({pp['build_number']})"
        assert row["peer"] == "llama.cpp K q8_0 V q4_0"


@pytest.mark.parametrize("make, message", [
    (lambda tmp: str(tmp / "missing"), "is not a file"),
    (lambda tmp: (tmp / "plain").write_text("x") and str(tmp / "plain"), "is not executable"),
])
def test_a_bad_llama_bench_path_is_one_line_before_anything_loads(make, message, tmp_path, capsys):
    code, _, err = run_cli(["bench", "--model", str(tmp_path / "no-model.gguf"), "--llama-bench", make(tmp_path)],
                           capsys)
    assert code == 2 and message in err and "Traceback" not in err
