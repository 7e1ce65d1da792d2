"""Every script in examples/ runs and prints what its docs page says it prints.

Scripts are found by globbing examples/*.py, so a new example cannot be left out: one that
is missing from EXAMPLES fails until it is given its arguments and a line to expect. Each
runs as a learner would run it: `python examples/NAME.py` from the repository root, in a
fresh process (not under the CUDA simulator the other tests switch on), with
STRATA_NB_HOME passed through so the model-backed ones find the cached default model.

Where a page shows what a script prints (docs/measured/example_NAME.md, written by
`python tools/measure_docs.py examples`), the script must still print exactly that.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "docs" / "measured"
SCRIPTS = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

# name: (arguments that keep it short, a line fragment it must print, needs the default model)
EXAMPLES = {
    "quantize_one_cell.py": ([], "k8v4:", False),
    "stream_blocks.py": ([], "total: ", False),
    "ring_restore.py": ([], "host copy == snapshot", False),
    "generate.py": (["--max-tokens", "8", "--max-context", "512"], "generated 8 tokens", True),
    "chat_client.py": (["--max-tokens", "12"], "strata_nb_cached_tokens_total 512", True),
    "fault_lab.py": (["--chars", "2000", "--kv-window", "64", "--max-tokens", "12"], "outputs identical: False", True),
    "moe_oracle.py": ([], "16 greedy tokens agree: True", False),
    "expert_cache.py": ([], "every cache size gives the all-resident logits: True; the fault is caught: True", False),
}


def params():
    for name in SCRIPTS:
        needs_model = EXAMPLES.get(name, ([], "", False))[2]
        yield pytest.param(name, id=name, marks=[pytest.mark.model] if needs_model else [])


@pytest.mark.parametrize("name", list(params()))
def test_example_runs(name, request):
    assert name in EXAMPLES, f"examples/{name} is new: add it to EXAMPLES in {Path(__file__).name}"
    args, expected, needs_model = EXAMPLES[name]
    if needs_model:
        request.getfixturevalue("default_model_path")  # fetch once, before the script needs it
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, f"examples/{name}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert expected in run.stdout, run.stdout
    captured = MEASURED / f"example_{Path(name).stem}.md"
    if captured.exists():
        shown = captured.read_text().split("```text\n", 1)[1].rsplit("\n```", 1)[0]
        assert run.stdout.rstrip() == shown, \
            f"examples/{name} no longer prints what its page shows: run python tools/measure_docs.py examples"


def test_every_example_is_listed():
    assert SCRIPTS, "examples/ has no scripts"
    assert sorted(EXAMPLES) == SCRIPTS, "EXAMPLES and examples/*.py differ"
