"""Golden greedy output, in the manner of llama2.c: exact token ids at temperature 0.

The default model, fp16 KV, numpy backend, the chat template, 32 new tokens at most. If a
change moves any of these ids, it changed the numbers the engine computes: find out why
before updating them. llama.cpp's own greedy output for the same prompts is in
tests/fixtures/llama_greedy.json; the second test compares against it.
"""
import json
from pathlib import Path

import pytest

from strata_nb.settings import SamplingSettings

pytestmark = [pytest.mark.model, pytest.mark.slow]  # the 30-layer model on the CPU: a minute or more

GOLDEN = [
    ('What is the capital of France?',
     [504, 3575, 282, 4649, 314, 7042, 30]),
    ('Write a haiku about the sea.',
     [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282, 260, 10393, 28, 198, 49, 13151, 282, 260, 6122, 338, 5721, 8823, 28, 198, 49, 13151]),
    ('List three uses of a paperclip.',
     [33, 30, 330, 1941, 14194, 314, 804, 288, 1464, 253, 40679, 1941, 5690, 30, 198, 34, 30, 330, 1941, 14194, 314, 804, 288, 1464, 253, 40679, 1941, 5690, 30, 198, 35, 30]),
]


@pytest.mark.parametrize("prompt, want", GOLDEN)
def test_golden_greedy_ids(engine_for, prompt, want):
    eng = engine_for("fp16", max_context=512)
    got = []
    list(eng.generate_ids(eng.prompt_ids(prompt), SamplingSettings(max_tokens=32), on_token=got.append))
    assert got == want


def test_agrees_with_llama_cpp_f32_greedy(engine_for):
    """Our fp32-cache greedy equals llama.cpp's (F32 file, f32 cache) until its first near tie."""
    ref = json.loads((Path(__file__).parent / "fixtures" / "llama_greedy.json").read_text())["f32"]["completions"]
    eng = engine_for("fp32", max_context=1024)
    for case in ref:
        got = []
        list(eng.generate_ids(case["prompt_ids"], SamplingSettings(max_tokens=len(case["ids"]) or 1),
                              on_token=got.append))
        # compare up to the first step whose top-1 margin in llama.cpp was under 0.05
        stop = next((i for i, m in enumerate(case["top1_margins"]) if m < 0.05), len(case["ids"]))
        assert got[:stop] == case["ids"][:stop], case["user"]
