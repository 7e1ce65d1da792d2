"""The CLI on a tiny random-weight model: streaming, stdin, --stats, info, and bad input."""
import io
import json

import pytest

from strata_nb.cli import main


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_run_streams_text(tiny_model, capsys):
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "5", "--device", "cpu", "hello"], capsys)
    assert code == 0 and out.endswith("\n") and err == ""


def test_run_reads_stdin_and_prints_stats(tiny_model, capsys, monkeypatch):
    code, out, err = run_cli(["run", "--model", tiny_model, "--max-tokens", "4", "--stats", "--raw"], capsys,
                             stdin="from stdin", monkeypatch=monkeypatch)
    assert code == 0
    assert "prompt tokens: 10" in err and "prefill:" in err and "decode:" in err


@pytest.mark.parametrize("argv, message", [
    (["run", "   "], "the prompt is empty"),
    (["run", "--max-context", "16", "--raw", "x" * 40], "does not fit --max-context 16"),
    (["run", "--temperature", "-1", "hi"], "--temperature must be >= 0"),
    (["run", "--kv", "bogus", "hi"], "'bogus' is not one of"),
    (["run", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    (["run", "--max-context", "4", "hi"], "--max-context must be at least 16"),
    (["run", "--max-tokens", "x", "hi"], "'x' is not a valid integer"),
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


def test_compare_kv_bad_budget(tiny_model, capsys):
    code, _, err = run_cli(["compare-kv", "--model", tiny_model, "--qsa-budget", "lots"], capsys)
    assert code == 2 and "--qsa-budget takes comma-separated cell counts" in err
