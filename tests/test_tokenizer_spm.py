"""SentencePiece vocabularies ("llama" in GGUF) tokenize as llama.cpp tokenizes them.

A made-up vocabulary checks each rule on its own (no download); Gemma 3 270M's, where it
is fetched, is held to llama.cpp's own tokenizer (llama-cpp-python) on varied text.
"""
import time

import pytest

from strata_nb.errors import StrataError
from strata_nb.text.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types

# token, type, score: specials first, then pieces whose scores set the merge order
PIECES = [("<pad>", CONTROL, 0.0), ("<eos>", CONTROL, 0.0), ("<bos>", CONTROL, 0.0), ("<unk>", UNKNOWN, 0.0),
          ("<start_of_turn>", CONTROL, 0.0), ("<end_of_turn>", CONTROL, 0.0), ("<unused0>", UNUSED, 0.0),
          ("\n", USER_DEFINED, 0.0), ("\n\n", USER_DEFINED, 0.0), ("=>", USER_DEFINED, 0.0), (">>=", USER_DEFINED, 0.0),
          ("▁", NORMAL, -1.0), ("a", NORMAL, -1.0), ("b", NORMAL, -1.0), ("c", NORMAL, -1.0), ("h", NORMAL, -1.0),
          ("i", NORMAL, -1.0), ("ab", NORMAL, -2.0), ("ba", NORMAL, -2.0), ("bc", NORMAL, -1.5), ("aa", NORMAL, -3.0),
          ("▁h", NORMAL, -4.0), ("hi", NORMAL, -5.0)]
BYTES = [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]


class Metadata:
    """What Tokenizer reads of a GGUF: metadata(key, default)."""

    def __init__(self, **fields):
        self.fields = {f"tokenizer.ggml.{k}": v for k, v in fields.items()}

    def metadata(self, key, default=None):
        return self.fields.get(key, default)


def tiny(space_prefix=False, pieces=PIECES, **fields):
    vocab = pieces + BYTES
    fields = dict(model="llama", tokens=[t for t, _, _ in vocab], token_type=[k for _, k, _ in vocab],
                  scores=[s for _, _, s in vocab], bos_token_id=2, eos_token_id=1, add_bos_token=True,
                  add_space_prefix=space_prefix) | fields
    return Tokenizer(Metadata(**fields))


@pytest.fixture(scope="module")
def tok():
    return tiny()


def ids(tok, *pieces):
    return [tok.tokens.index(p) for p in pieces]


def test_the_pair_of_highest_score_merges_first(tok):
    assert tok.encode("abc") == ids(tok, "a", "bc")  # bc (-1.5) before ab (-2)
    # negative control: the same text with ab the better pair merges the other way
    swapped = tiny(pieces=[(t, k, -1.0 if t == "ab" else s) for t, k, s in PIECES])
    assert swapped.encode("abc") == ids(swapped, "ab", "c")


def test_equal_scores_merge_the_leftmost_pair(tok):
    assert tok.encode("aaa") == ids(tok, "aa", "a")
    assert tok.encode("aaaaa") == ids(tok, "aa", "aa", "a")
    assert tok.encode("abab") == ids(tok, "ab", "ab")  # ab and ba score alike: ab stands left


def test_a_character_the_vocabulary_lacks_falls_back_to_its_bytes(tok):
    assert tok.encode("é") == ids(tok, "<0xC3>", "<0xA9>")
    assert tok.encode("a😀b") == ids(tok, "a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "b")


def test_spaces_are_pieces_and_the_space_prefix(tok):
    assert tok.encode("hi hi") == ids(tok, "hi", "▁h", "i")  # the space is '▁'; ▁h (-4) merges before hi (-5)
    spaced = tiny(space_prefix=True)
    # a space before the text and after each special token, none after plain text
    assert spaced.encode("hi") == ids(spaced, "▁h", "i")
    assert spaced.encode("hi<end_of_turn>hi") == ids(spaced, "▁h", "i", "<end_of_turn>", "▁h", "i")
    assert spaced.decode(spaced.encode("hi")) == " hi"  # decode keeps it: a generated token's space is real


def test_special_tokens_longest_first_then_leftmost(tok):
    assert tok.encode("<start_of_turn>hi<end_of_turn>\n") == ids(tok, "<start_of_turn>", "hi", "<end_of_turn>", "\n")
    assert tok.encode("\n\n\n") == ids(tok, "\n\n", "\n")
    assert tok.encode("<unk>") == ids(tok, "<unk>")  # unknown-type tokens are cut out too, as llama.cpp does
    # => and >>= overlap in "=>>=": llama.cpp takes the longer one everywhere first, so the
    # leftmost match (=> then ">=") is not what it does
    assert tok.encode("=>>=") == ids(tok, "<0x3D>", ">>=")
    assert tok.encode("=>=>") == ids(tok, "=>", "=>")
    assert tok.encode("<unused0>") == ids(tok, *(f"<0x{b:02X}>" for b in b"<unused0>"))  # unused: plain text


def test_decode_round_trips_and_token_bytes(tok):
    for text in ["abc hi  é😀", "<start_of_turn>user\nhi<end_of_turn>\n", " a\tb\n\n\nc ", "=>>=", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_bytes(tok.tokens.index("▁h")) == b" h"
    assert tok.token_bytes(tok.tokens.index("<0x41>")) == b"A"
    assert tok.token_bytes(tok.tokens.index("<end_of_turn>")) == b"<end_of_turn>"
    assert tok.token_bytes(tok.tokens.index("\n")) == b"\n"
    assert tok.token_bytes(tok.tokens.index("<unused0>")) == b""  # llama.cpp gives unused tokens no text


def test_attributes(tok):
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (2, 1, True, None)
    assert tok.stop_ids == {1, tok.tokens.index("<end_of_turn>")}
    assert tok.vocab_size == len(PIECES) + 256
    assert tiny(add_bos_token=False).add_bos is False
    with pytest.raises(StrataError, match="unsupported tokenizer model 't5'"):
        Tokenizer(Metadata(model="t5", tokens=["a"]))


def test_tiny_vocabulary_equals_llama_cpp(tmp_path):
    """The same vocabulary written to a GGUF and read by llama.cpp: the rules above are its."""
    import gguf

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    vocab = PIECES + BYTES
    for space_prefix in (False, True):
        path = tmp_path / f"spm_{space_prefix}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(8)
        w.add_head_count(1)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("llama")
        w.add_token_list([t for t, _, _ in vocab])
        w.add_token_types([k for _, k, _ in vocab])
        w.add_token_scores([s for _, _, s in vocab])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_add_space_prefix(space_prefix)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        tok = tiny(space_prefix=space_prefix)
        for text in ["abc", "aaaaa", "abab", "a😀b", "hi hi", "hi<end_of_turn>hi", "<start_of_turn>hi<end_of_turn>\n",
                     "\n\n\n", "<unk>", "=>>=", "<unused0>", " a\tb\n\n\nc ", ""]:
            assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=False, special=True), repr(text)
        for i in range(len(vocab)):
            assert tok.token_bytes(i) == llm.detokenize([i], special=True), (i, vocab[i][0])


# ---- Gemma 3 270M against llama.cpp ---------------------------------------------------
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space", "trailing space ",
    "two  spaces and   three", "   ", " ", "", "line one\nline two\n\nline four\n", "tab\there\t\ttwo tabs",
    "\r\n windows line\r\n", "1234567890 3.14159 1,000,000", "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i]; }", "emoji 😀👍🏽 family 👨‍👩‍👧", "日本語のテキストと中文文本",
    "한국어 텍스트", "héllo wörld, façade, naïve, Ærøskøbing", "Привет, мир", "مرحبا بالعالم",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\n",
    "<bos>text<eos>", "<b>bold</b> and <table><tr><td>cell</td></tr></table>", "<unused12><unused1> x",
    "rare bytes \x00\x01\x1b\x7f\u200b\ufeff\U0001d54f", "▁already escaped ▁▁", "a" * 40 + " " * 40 + "\n" * 40,
    "https://example.com/path?query=1&b=2#frag", "SHOUTING AND MiXeD cAsE wOrDs", "<start_of_image>",
]


@pytest.fixture(scope="module")
def gemma():
    from strata_nb.model.fetch import named_model_path
    from strata_nb.model.gguf_file import GGUFModel

    path = named_model_path("gemma3-270m")
    if not path.is_file():
        pytest.skip("Gemma 3 270M is not fetched (strata-nb fetch --model gemma3-270m)")
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    model = GGUFModel(path)
    start = time.perf_counter()
    tok = Tokenizer(model)
    load_s = time.perf_counter() - start
    return tok, load_s, llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.model
def test_gemma_ids_equal_llama_cpp(gemma):
    tok, load_s, llm = gemma
    assert len(TEXTS) >= 30
    assert load_s < 2, f"the 262,144-token vocabulary took {load_s:.2f} s to build"
    for text in TEXTS:
        ours = tok.encode(text)
        assert ours == llm.tokenize(text.encode("utf-8"), add_bos=False, special=True), repr(text)
        theirs = llm.detokenize(ours, special=True)
        assert tok.decode(ours) == theirs.decode("utf-8", errors="replace"), repr(text)
        if theirs == text.encode("utf-8"):  # all but "▁already escaped ▁▁", which comes back as spaces
            assert tok.decode(ours) == text, repr(text)


@pytest.mark.model
def test_gemma_attributes_and_pieces_equal_llama_cpp(gemma):
    tok, _, llm = gemma
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (2, 1, True, None)
    assert tok.add_space_prefix is False and tok.vocab_size == 262_144
    assert {1, tok.tokens.index("<end_of_turn>")} <= tok.stop_ids
    # control, unknown, user-defined ("\n", two spaces, <table>), byte, '▁' pieces, the last id
    picked = [0, 1, 2, 3, 105, 106, 107, 138, 168, 238, 238 + 0xC3, 255968, 255999, tok.vocab_size - 1]
    picked += [tok.tokens.index(t) for t in ("▁", "▁the", "Hello", "日本")]
    for i in picked:
        assert tok.token_bytes(i) == llm.detokenize([i], special=True), (i, tok.tokens[i])
