"""Token ids equal llama.cpp's; detokenizing streams whole UTF-8 characters."""
import json
from pathlib import Path

import pytest

from strata_nb.model.gguf_file import GGUFModel
from strata_nb.text.tokenizer import StreamDecoder, Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tok(default_model_path):
    return Tokenizer(GGUFModel(default_model_path))


@pytest.mark.model
def test_ids_equal_llama_cpp(tok):
    cases = json.loads((FIXTURES / "llama_tokens.json").read_text())["cases"]
    assert len(cases) >= 25
    for case in cases:
        assert tok.encode(case["text"]) == case["ids"], repr(case["text"])


@pytest.mark.model
def test_round_trip_and_specials(tok):
    for text in ["héllo wörld 日本語 👨‍👩‍👧", "def f(x):\n\treturn x  # hi", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [2]
    assert {0, 2} <= tok.stop_ids


@pytest.mark.model
def test_stream_decoder_never_splits_a_character(tok):
    text = "emoji 👍🏽 and 家族 and é"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the thumbs-up is split over several tokens: some pushes must have held bytes back
    assert any(p == "" for p in pieces[:-1])


@pytest.mark.model
def test_chat_template(tok):
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
