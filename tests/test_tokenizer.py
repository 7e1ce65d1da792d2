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
def test_stretches_between_special_tokens_keep_their_ids(tok, monkeypatch):
    """encode splits on special tokens and keeps each stretch's ids: the ids are the BPE
    library's for the whole text, and a conversation's next turn encodes only its new
    stretches."""
    turns = [dict(role="user", content="Héllo there,  friend 12345!\n\nA second line."),
             dict(role="assistant", content=" Sure <|im_end|> text\twith tabs<|im_start|>"),
             dict(role="user", content="<|endoftext|>and  more   spaces ")]
    for n in range(1, 4):
        text = tok.render_chat(turns[:n])
        assert tok.encode(text) == tok._hf.encode(text, add_special_tokens=False).ids, text
    calls = []
    real = tok._hf.encode
    monkeypatch.setattr(tok, "_hf", type("HF", (), {"encode": lambda self, t, **kw: calls.append(t) or real(t, **kw)})())
    tok.encode(tok.render_chat(turns[:2]))
    assert calls == []  # every stretch seen before
    tok.encode(tok.render_chat(turns[:2] + [dict(role="user", content="a new question")]))
    assert calls == ["user\na new question"]  # the rest, the 2-turn history included, from the cache


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
