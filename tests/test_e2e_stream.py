"""End to end on the default model (numpy backend): greedy output with --kv-resident at its
minimum, on a prompt more than 4x longer than the resident cells, is byte-identical to fully
resident for every format; the fault switch breaks it; a planted fact is retrieved streamed."""
from importlib import resources

import pytest

from strata_nb.kv.plan import StreamPlan
from strata_nb.settings import SamplingSettings

pytestmark = [pytest.mark.model, pytest.mark.slow]
MINIMUM = StreamPlan.minimum_cells(256)  # 320 cells per layer at the default --kv-window
DOC = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()


@pytest.fixture(scope="module")
def base(engine_for):
    return engine_for("fp16", max_context=4096)


def greedy_ids(eng, prompt, n=24):
    ids = eng.prompt_ids(prompt)
    out = []
    text = "".join(eng.generate_ids(ids, SamplingSettings(max_tokens=n), on_token=out.append))
    return ids, out, text


LONG = DOC[:6200] + "\n\nSummarize the text above in two sentences."


@pytest.mark.parametrize("fmt", ["fp16", "int8", "q4_0", "k8v4"])
def test_streamed_greedy_is_byte_identical(base, fmt):
    resident = base.derive(kv=fmt)
    streamed = base.derive(kv=fmt, kv_resident=MINIMUM)
    ids, want, text = greedy_ids(resident, LONG)
    assert len(ids) >= 4 * MINIMUM
    _, got, got_text = greedy_ids(streamed, LONG)
    assert got == want and got_text == text
    c = streamed.kv.counters
    assert c.misses > 0 and c.lookups > c.misses


def test_fault_switch_changes_the_output(base):
    _, want, text = greedy_ids(base.derive(kv="k8v4"), LONG)
    faulty = base.derive(kv="k8v4", kv_resident=MINIMUM, fault="drop-v-mirror")
    _, got, bad_text = greedy_ids(faulty, LONG)
    assert got != want, bad_text


def test_planted_fact_is_retrieved_streamed(base):
    paras = DOC.split("\n\n")
    half = len(paras) // 2
    fact = "Note for the reader: the secret password for the archive is PELICAN-42."
    text = "\n\n".join(paras[:half] + [fact] + paras[half:] + paras[1:4])
    prompt = text + "\n\nQuestion: What is the secret password for the archive? Answer with the password only."
    streamed = base.derive(kv="k8v4", kv_resident=MINIMUM)
    ids, _, answer = greedy_ids(streamed, prompt, n=16)
    assert len(ids) >= 3000
    assert "PELICAN-42" in answer
