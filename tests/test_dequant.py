"""The NumPy dequantizers (the references the GPU matvec kernels will match) against gguf's."""
import gguf
import numpy as np
import pytest

from strata_nb.model.dequant import dequantize

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, cols", [(1, 32), (7, 96), (13, 576)])
def test_dequant_matches_gguf(qtype, rows, cols):
    rng = np.random.default_rng(rows * cols)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(T, qtype))  # (rows, bytes_per_row) uint8
    ours = dequantize(raw, qtype)
    theirs = gguf.quants.dequantize(raw, getattr(T, qtype))
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype, dtype", [("F32", np.float32), ("F16", np.float16)])
def test_dequant_float_types(qtype, dtype):
    w = np.random.default_rng(1).standard_normal((5, 40)).astype(dtype)
    raw = w.view(np.uint8).reshape(5, -1)
    np.testing.assert_array_equal(dequantize(raw, qtype), w.astype(np.float32))


@pytest.mark.model
def test_dequant_default_model_tensors(default_model_path):
    from strata_nb.model.gguf_file import GGUFModel

    m = GGUFModel(default_model_path)
    for name in ["token_embd.weight", "blk.3.attn_k.weight", "blk.29.ffn_down.weight", "output_norm.weight"]:
        t = m.tensors[name]
        q = m.tensor(name)
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(q.shape)
        np.testing.assert_array_equal(dequantize(q.raw, q.qtype), theirs)


# Where each K-quant keeps its fp16 fields (d, and dmin) in its super-block, and Q5_0's d.
F16_FIELDS = {"Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rng, qtype, rows, blocks):
    """Random bytes in every code, scale and high-bit field; finite fp16 d and dmin."""
    from strata_nb.model.dequant import BLOCK_BYTES

    raw = rng.integers(0, 256, (rows, blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[..., at:at + 2] = rng.uniform(-0.1, 0.1, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS))
@pytest.mark.parametrize("rows, blocks", [(1, 1), (3, 2), (5, 3)])
def test_the_k_quants_and_q5_0_match_gguf(qtype, rows, blocks):
    """gguf-py cannot quantize to the K-quants, so the bytes are random: every bit of every
    code, scale, min and high-bit field is read as gguf-py reads it, bit for bit."""
    raw = random_blocks(np.random.default_rng(rows * 10 + blocks), qtype, rows, blocks)
    ours, theirs = dequantize(raw, qtype), gguf.quants.dequantize(raw, getattr(T, qtype))
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert ours.tobytes() == theirs.tobytes()


def test_a_k_quant_file_is_refused_when_opened(tmp_path):
    """The references are here, the kernels are not: a tensor of a K-quant type names
    itself and the types the engine reads."""
    from strata_nb.errors import StrataError
    from strata_nb.model.gguf_file import GGUFModel
    from strata_nb.model.synthetic import write_synthetic_gguf

    raw = random_blocks(np.random.default_rng(0), "Q4_K", 2, 1)
    path = write_synthetic_gguf(tmp_path / "k.gguf", n_layers=1, extra_tensor=("extra.weight", raw, T.Q4_K))
    with pytest.raises(StrataError, match="Q4_K.*supported: F32, F16, Q4_0, Q4_1, Q8_0"):
        GGUFModel(str(path))
