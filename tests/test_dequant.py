"""The NumPy dequantizers (the references the GPU matvec kernels will match) against gguf's."""
import gguf
import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.model.dequant import K_QUANT_F16, dequantize

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
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


# Where each K-quant keeps its fp16 fields (d, and dmin) in its super-block, and Q5_0's d,
# Q5_1's d and m.
F16_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2)} | K_QUANT_F16


def random_blocks(rng, qtype, rows, blocks):
    """Random bytes in every code, scale and high-bit field; finite fp16 d and dmin."""
    from strata_nb.model.dequant import BLOCK_BYTES

    raw = rng.integers(0, 256, (rows, blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[..., at:at + 2] = rng.uniform(-0.1, 0.1, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS))
@pytest.mark.parametrize("rows, blocks", [(1, 1), (3, 2), (5, 3)])
def test_the_k_quants_and_q5_match_gguf(qtype, rows, blocks):
    """gguf-py cannot quantize to the K-quants, so the bytes are random: every bit of every
    code, scale, min and high-bit field is read as gguf-py reads it, bit for bit."""
    raw = random_blocks(np.random.default_rng(rows * 10 + blocks), qtype, rows, blocks)
    ours, theirs = dequantize(raw, qtype), gguf.quants.dequantize(raw, getattr(T, qtype))
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert ours.tobytes() == theirs.tobytes()


def test_a_k_quant_model_answers_on_the_cpu(k_quant_model, capsys):
    from cli_runner import run_cli

    code, out, err = run_cli(["run", "--model", k_quant_model, "--device", "cpu", "--raw", "--max-tokens", "4",
                              "hi"], capsys)
    assert code == 0 and out.strip(), err


@pytest.mark.sim_engine
@pytest.mark.parametrize("qtype", ["Q4_K"] if not ON_GPU else ["Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_both_tiers_run_a_k_quant_model_as_the_numpy_backend_does(qtype, tmp_path):
    """Prefill and decode steps on the plain tier's kernels (gguf_rows.py's K-quant parts)
    and the fast tier's (the same parts, gguf_fetch.py's fetch_whole) give the numpy
    backend's logits (1e-3 of the largest, as the cuda backend's forward test) and its
    greedy picks: 2 prompt tokens and 1 step under the simulator (minutes), 8 and 16 on a
    GPU."""
    from strata_nb import Engine
    from strata_nb.model.synthetic import write_synthetic_gguf

    path = str(write_synthetic_gguf(tmp_path / f"{qtype}.gguf", n_layers=1, d_model=256, d_ff=256, n_heads=4,
                                    n_kv_heads=2, head_dim=64, qtype=qtype))
    prompt, steps = ([5, 6], 1) if not ON_GPU else (list(range(5, 13)), 16)
    runs = []
    for device, kernels in (("cpu", "plain"), ("cuda", "plain"), ("cuda", "fast")):
        eng = Engine.load(model=path, device=device, kernels=kernels, max_context=64)
        logits = [eng.prefill(prompt)]
        for pos in range(len(prompt), len(prompt) + steps):
            logits.append(eng.decode_one_token(int(np.argmax(logits[-1])), pos))
        runs.append(np.stack(logits))
    want = runs[0]
    for got in runs[1:]:
        assert (np.abs(got - want) <= 1e-3 * np.abs(want).max(axis=1, keepdims=True)).all()
        assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("backend", ["plain", "fast"])
def test_a_fused_matrix_of_mixed_types_is_stored_as_its_exact_weights(backend):
    """A K-quant mix gives q|k|v different types (a Q4_K_M file of the default model:
    Q5_0, Q5_0 and Q8_0); the cuda backend stores the fused rows as F32, each weight the
    numpy backend's dequantized value to the bit. One type stays as it is."""
    from strata_nb.backend import get_backend
    from strata_nb.backend.numpy_backend import NumpyBackend
    from strata_nb.model.gguf_file import QTensor

    rng = np.random.default_rng(3)

    def tensor(name, qtype, rows):
        w = rng.standard_normal((rows, 64)).astype(np.float32)
        return QTensor(name, qtype, (rows, 64), gguf.quants.quantize(w, getattr(T, qtype)))

    q, k, v = tensor("q", "Q5_0", 8), tensor("k", "Q5_0", 4), tensor("v", "Q8_0", 4)
    be = get_backend("cuda", backend)
    fused = be.matrix(q, k, v)
    assert fused.qtype == "F32" and fused.shape == (16, 64)
    want = NumpyBackend().matrix(q, k, v)
    assert fused.raw.copy_to_host().view(np.float32).tobytes() == want.astype(np.float32).tobytes()
    assert be.matrix(v).qtype == "Q8_0"
