"""The CLI on a tiny random-weight model: streaming, stdin, --stats, info, and bad input."""
import dataclasses
import io
import json

import pytest

from strata_nb.cli import cli
from strata_nb.errors import StrataError
from strata_nb.settings import SamplingSettings, Settings
from cli_runner import run_cli


def test_run_streams_text(tiny_model, capsys):
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "5", "--device", "cpu", "hello"], capsys)
    assert code == 0 and out.endswith("\n") and err == ""


def test_run_reads_stdin_and_prints_stats(tiny_model, capsys, monkeypatch):
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "4", "--stats", "--raw"], capsys,
                             stdin="from stdin", monkeypatch=monkeypatch)
    assert code == 0
    assert "prompt tokens: 10" in err and "prefill:" in err and "decode:" in err


def test_stats_say_when_the_first_token_came(tiny_model, capsys, monkeypatch):
    """The first token's time counts from the command's start (in a test: main's call), the
    model's load included: at least the load, at most the command's wall time."""
    import re
    import time

    from strata_nb import Engine

    real_load = Engine.load.__func__

    def slow_load(cls, *args, **kwargs):  # a load that takes a known 0.3 s at least
        time.sleep(0.3)
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(slow_load))
    began = time.monotonic()
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "3", "--stats", "hi"], capsys)
    wall = time.monotonic() - began
    assert code == 0, err
    first = re.search(r"first token: ([0-9.]+) s after the command started", err)
    assert first is not None, err
    assert 0.3 <= float(first.group(1)) <= wall + 0.005  # printed to 0.01 s


@pytest.mark.parametrize("made, says", [((3, 5), "(3 kernels compiled, 5 kernels loaded from the cache"),
                                         ((0, 7), "(7 kernels loaded from the cache")])
def test_stats_say_which_kernels_were_compiled_and_which_loaded(made, says, tiny_model, capsys, monkeypatch):
    """On a GPU the warm-up makes the kernels (src/strata_nb/kernel_cache.py); a run that loaded them
    all from the cache does not claim it compiled. Its counts stand in for a GPU's here."""
    from strata_nb import Engine

    monkeypatch.setattr(Engine, "warm_up", lambda self, ids: made)
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "2", "--stats", "hi"], capsys)
    assert code == 0 and says in err and ("compiled" in err) == bool(made[0])


@pytest.mark.parametrize("argv, message", [
    (["run", "   "], "the prompt is empty"),
    (["run", "--max-context", "16", "--raw", "x" * 40], "--max-context 16 does not fit the prompt's 40 tokens"),
    (["run", "--temperature", "-1", "hi"], "--temperature must be >= 0"),
    (["run", "--kv", "bogus", "hi"], "'bogus' is not one of"),
    (["run", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    (["run", "--max-context", "4", "hi"], "--max-context must be at least 16"),
    (["run", "--max-tokens", "x", "hi"], "'x' is not a valid integer"),
    (["run", "--seed", "-5", "hi"], "--seed must be >= 0"),
    (["run", "--expert-cache", "3", "hi"], "--expert-cache 3 caches an MoE model's experts; this model is dense"),
    (["run", "--kernels", "fastest", "hi"], "'fastest' is not one of 'plain', 'fast'"),
    (["bench", "--device", "cpu", "--kernels", "plain,fast", "--depths", "4"],
     "--kernels picks the cuda backend's tiers; the numpy backend (--device cpu) runs the references"),
    (["bench", "--kernels", "plain,faster", "--depths", "4"], "--kernels takes tiers from plain, fast, mega, got 'plain,faster'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tiny_model, capsys):
    code, out, err = run_cli(argv[:1] + ["--model", tiny_model] + argv[1:], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata-nb: error:") and message in lines[0], err


def test_no_prompt_and_no_stdin(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", None)
    code, _, err = run_cli(["run", "--model", tiny_model], capsys)
    assert code == 2 and "give a prompt" in err


@pytest.mark.model
@pytest.mark.parametrize("kv, cell, per_token", [("fp16", 768, 23040), ("int8", 396, 11880),
                                                 ("q4_0", 216, 6480), ("k8v4", 306, 9180)])
def test_info_json_kv_sizes(kv, cell, per_token, default_model_path, capsys):
    code, out, _ = run_cli(["info", "--model", default_model_path, "--kv", kv, "--json"], capsys)
    facts = json.loads(out)
    assert code == 0 and facts["n_layers"] == 30 and facts["n_kv_heads"] == 3
    assert facts["cell_bytes"] == cell and facts["block_bytes"] == cell * 16
    assert facts["bytes_per_token"] == per_token and facts["bytes_at_max_context"] == per_token * 8192
    assert sum(r["bytes"] for r in facts["runs"]) == cell * 16
    assert len(facts["runs"]) == {"fp16": 2, "int8": 4, "q4_0": 2, "k8v4": 3}[kv]


def test_a_qsa_budget_below_the_window_says_what_a_query_reads(tiny_model, capsys):
    code, _, err = run_cli(["run", "--model", tiny_model, "--device", "cpu", "--qsa-budget", "32", "--max-tokens", "1",
                            "hi"], capsys)
    assert code == 0 and "--qsa-budget 32 is below what a query always reads" in err and "at most 272 cells" in err
    code, _, err = run_cli(["run", "--model", tiny_model, "--device", "cpu", "--qsa-budget", "288", "--max-tokens", "1",
                            "hi"], capsys)
    assert code == 0 and "qsa-budget" not in err


def test_compare_kv_json(tiny_model, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the keeper climbed the stairs and lit the lamp. " * 4)
    code, out, _ = run_cli(["compare-kv", "--model", tiny_model, "--text", str(text), "--ctx", "150",
                            "--kv", "fp32,k8v4", "--qsa-budget", "0,32", "--device", "cpu", "--json"], capsys)
    result = json.loads(out)
    rows = {(r["kv"], r["qsa_budget"]): r for r in result["rows"]}
    assert code == 0 and result["tokens"] == 150 and len(rows) == 4
    same = rows[("fp32", 0)]  # the reference against itself, through the same path: exactly equal
    assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["ppl_change"] == 0.0
    assert rows[("k8v4", 0)]["mean_kl"] > 0 and rows[("k8v4", 32)]["mean_kl"] > 0
    assert all(0 <= r["top1_agreement"] <= 1 for r in rows.values())


def test_compare_kv_scores_a_text_shorter_than_a_block(tiny_model, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("the lamp")
    code, out, err = run_cli(["compare-kv", "--model", tiny_model, "--text", str(text), "--kv", "k8v4",
                              "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == len("the lamp") and result["rows"][0]["mean_kl"] >= 0  # the tiny model's bytes


def test_compare_kv_bad_budget(tiny_model, capsys):
    code, _, err = run_cli(["compare-kv", "--model", tiny_model, "--qsa-budget", "lots"], capsys)
    assert code == 2 and "--qsa-budget takes comma-separated cell counts" in err


def test_bare_command_prints_the_help_and_exits_0(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: strata-nb") and "Commands:" in out and "compare-kv" in out


def test_non_utf8_stdin_is_one_line_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """A real stdin is bytes beneath the text: a Latin-1 file piped in. The model path does
    not exist, so an error about it would mean the model was reached first."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait"), encoding="utf-8"))
    code, out, err = run_cli(["run", "--model", str(tmp_path / "absent.gguf")], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["strata-nb: error: stdin is not UTF-8 text: byte 0xe9 at offset 3 "
                                        "(convert it first, e.g. iconv -t UTF-8)"]


def test_non_utf8_prompt_argument_is_one_line(capsys, tmp_path):
    """Python hands argv's undecodable bytes over as lone surrogates (surrogateescape)."""
    code, _, err = run_cli(["run", "--model", str(tmp_path / "absent.gguf"), "caf\udce9"], capsys)
    assert code == 2 and "the prompt is not UTF-8 text: byte 0xe9 at offset 3" in err


def test_the_api_refuses_text_that_is_not_unicode(tiny_model):
    from strata_nb import Engine

    eng = Engine.load(model=tiny_model, device="cpu")
    with pytest.raises(StrataError, match="not valid Unicode: '\\\\udce9' at index 3"):
        eng.tokenize("caf\udce9")


def test_a_prompt_of_several_chunks_shows_prefill_progress_on_stderr_only(tiny_model, capsys):
    from strata_nb import Engine
    from strata_nb.settings import SamplingSettings

    prompt = "the keeper climbed the stairs"  # 29 byte-level tokens: 4 chunks of 8
    code, out, err = run_cli(["run", "--model", tiny_model, "--device", "cpu", "--raw", "--prefill-chunk", "8",
                              "--max-tokens", "6", prompt], capsys)
    assert code == 0
    assert all(f"| {n}/29 [" in err for n in (0, 8, 16, 24))  # drawn after each chunk, cleared after the last
    eng = Engine.load(model=tiny_model, device="cpu", prefill_chunk=8)
    assert out == "".join(eng.generate_ids(eng.prompt_ids(prompt, chat=False), SamplingSettings(6))) + "\n"
    code, _, err = run_cli(["run", "--model", tiny_model, "--device", "cpu", "--raw", "--prefill-chunk", "32",
                            "--max-tokens", "6", prompt], capsys)
    assert code == 0 and err == ""  # one chunk: nothing to wait for


@pytest.mark.parametrize("load, call, message", [
    ({}, lambda eng: list(eng.generate("hi", max_tokens=0)), "max_tokens must be at least 1, got 0"),
    ({}, lambda eng: list(eng.generate("hi", top_p=0.0)), "top_p must be in (0, 1], got 0.0"),
    ({"kv_window": 10}, None, "kv_window must be a positive multiple of 16 cells, got 10"),
    ({"device": "tpu"}, None, "device 'tpu' is not one of auto, cpu, cuda"),
    ({"max_context": 16}, lambda eng: eng.prompt_ids("x" * 40, chat=False),
     "max_context 16 does not fit the prompt's 40 tokens"),
])
def test_api_errors_name_the_parameter_not_the_flag(load, call, message, tiny_model):
    from strata_nb import Engine

    with pytest.raises(StrataError) as err:
        call(Engine.load(model=tiny_model, **({"device": "cpu"} | load)))
    assert str(err.value).startswith(message) and "--" not in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--kv-window", "10"], "--kv-window must be a positive multiple of 16 cells, got 10"),
])
def test_cli_errors_name_the_flag(argv, message, tiny_model, capsys):
    code, _, err = run_cli(["run", "--model", tiny_model, *argv, "hi"], capsys)
    assert code == 2 and err.strip() == f"strata-nb: error: {message}"


def test_every_setting_is_a_flag_of_run():
    """SettingError names a setting's flag by rule (max_tokens -> --max-tokens): each field
    must have that flag."""
    flags = {opt for p in cli.commands["run"].params for opt in p.opts}
    fields = [f.name for cls in (Settings, SamplingSettings) for f in dataclasses.fields(cls)]
    assert [f for f in fields if "--" + f.replace("_", "-") not in flags] == []


def test_stats_say_whether_launches_were_dependent(tiny_model, capsys, monkeypatch):
    """A run's --stats says whether its kernels launched
    as dependent ("on") or why not; a backend that has no such launches says nothing. The
    numpy backend's answer stands in for a GPU's here."""
    from strata_nb.backend.numpy_backend import NumpyBackend

    argv = ["run", "--model", tiny_model, "--max-tokens", "2", "--stats", "--device", "cpu", "hi"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "dependent launches" not in err
    monkeypatch.setattr(NumpyBackend, "dependent_launches", lambda self: "unavailable: compute capability (8, 0)")
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "dependent launches: unavailable: compute capability (8, 0)" in err


def test_a_model_cache_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("STRATA_NB_HOME", str(tmp_path / "a_file" / "home"))
    code, _, err = run_cli(["fetch"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "cannot make the model cache folder" in lines[0], err
    assert "STRATA_NB_HOME" in lines[0]
