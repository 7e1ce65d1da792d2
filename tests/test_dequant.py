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
