"""The metadata arrays read in one pass (model/gguf_file.py, `_Reader._flat_array`) give
what gguf-py's own reader gives, field by field: arrays of every number type and of
strings, in either byte order, an array of arrays (left to gguf-py), and a file cut short
inside the vocabulary."""
import gguf
import numpy as np
import pytest

from strata_nb.errors import StrataError
from strata_nb.model.gguf_file import GGUFModel, _Reader
from strata_nb.model.synthetic import SPECIALS, write_synthetic_gguf

T = gguf.GGUFValueType
NUMBERS = {T.UINT8: [0, 7, 255], T.INT8: [-128, 3, 127], T.UINT16: [1, 65535], T.INT16: [-32768, 9],
           T.UINT32: [2**32 - 1, 5], T.INT32: [-(2**31), 0, 17], T.UINT64: [2**64 - 1, 11],
           T.INT64: [-(2**63), 12], T.FLOAT32: [0.5, -1.25, 3e38], T.FLOAT64: [1e-300, 2.5],
           T.BOOL: [True, False, True]}
# strings of every UTF-8 length, an empty one, and GPT-2's byte alphabet as a vocabulary shows it
STRINGS = ["a", "", "Ġthe", "é", "€", "🙂 ok", "<|im_start|>", "Ċ Ċ"]


def write_arrays(path, endian):
    """A small model file whose metadata holds one array of each kind, in byte order `endian`."""
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    for vtype, values in NUMBERS.items():
        w.add_key_value(f"test.{vtype.name.lower()}", values, T.ARRAY, sub_type=vtype)
    w.add_key_value("test.strings", STRINGS, T.ARRAY, sub_type=T.STRING)
    w.add_key_value("test.long", [f"tok{i}" for i in range(3000)], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("test.nested", [[1, 2], [3, 4, 5]], T.ARRAY)
    w.add_key_value("test.scalar", 42, T.UINT32)
    w.add_key_value("test.text", "after the arrays", T.STRING)
    w.add_tensor("t", np.arange(32, dtype=np.float32).reshape(1, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_field_reads_as_gguf_py_reads_it(endian, tmp_path):
    path = write_arrays(tmp_path / f"{endian.name}.gguf", endian)
    ours, theirs = _Reader(path), gguf.GGUFReader(path)  # the reader alone: the file is no model
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert got.types == want.types and got.offset == want.offset, name
        assert got.contents() == want.contents(), name
        if want.types[0] == T.ARRAY:
            n = len(want.contents())
            for i in (0, n // 2, -1):
                assert got.contents(i) == want.contents(i) and type(got.contents(i)) is type(want.contents(i)), name
            assert got.contents(slice(1, 3)) == want.contents(slice(1, 3)), name
    assert ours.fields["test.strings"].contents() == STRINGS
    assert ours.fields["test.nested"].contents() == [1, 2, 3, 4, 5]  # gguf-py flattens an array of arrays
    assert ours.data_offset == theirs.data_offset
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


def test_the_two_byte_orders_differ(tmp_path):
    """The control for the test above: the big-endian file is not the little one's bytes,
    so its lengths and numbers go through the swapped reads."""
    little = write_arrays(tmp_path / "l.gguf", gguf.GGUFEndian.LITTLE).read_bytes()
    big = write_arrays(tmp_path / "b.gguf", gguf.GGUFEndian.BIG).read_bytes()
    assert len(little) == len(big) and little != big


def test_a_contents_list_is_the_callers_own(tiny_model):
    m = GGUFModel(tiny_model)
    tokens = m.metadata("tokenizer.ggml.tokens")
    tokens[0] = "changed"
    assert m.metadata("tokenizer.ggml.tokens")[0] != "changed"


@pytest.mark.parametrize("where", ["a length", "a string's bytes"])
def test_a_file_cut_inside_the_vocabulary_is_corrupt(where, tmp_path):
    tokens = SPECIALS + [f"word{i}" for i in range(500)]
    path = write_synthetic_gguf(tmp_path / "m.gguf", n_layers=1, tokens=tokens, merges=[])
    data = path.read_bytes()
    at = data.index(b"word250")  # the string's bytes; its u64 length is the 8 bytes before
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:at - 4] if where == "a length" else data[:at + 3])
    with pytest.raises(StrataError, match="truncated or corrupt: its header does not read"):
        GGUFModel(cut)
