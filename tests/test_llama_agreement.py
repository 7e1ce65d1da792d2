"""Agreement with llama.cpp on the same GGUF, teacher-forced over three texts (588 positions).

The fixtures come from tools/make_llama_fixtures.py (llama-cpp-python 0.3.36). The tight
check runs llama.cpp on an all-F32 copy of the GGUF with an f32 KV cache; that is an exact
float32 forward up to summation order, so our logits with the float32 reference cache must
match within 1e-3 (measured: ~7e-5). llama.cpp on the Q4_1 file itself quantizes the
activations to 8 bits inside its matmuls, so there only the ranking is compared.

The same check covers two mixture-of-experts files that `strata-nb moefy` makes from the
default model (the settings are in llama_moe_reference_meta.json; each test rebuilds its
file from them): the exact oracle (split, 8 experts all used, zero router), and a routed
file (split, 6 of 8 experts, a seeded random router), whose logits are llama.cpp's only if
every token in every layer takes the same 6 experts with the same weights.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_nb import Engine
from strata_nb.model.dequant import dequantize
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.moefy import moefy

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MOE_META = json.loads((FIXTURES / "llama_moe_reference_meta.json").read_text())


def _texts(name):
    z = np.load(FIXTURES / name)
    return [(z[f"ids_{i}"], z[f"topk_ids_{i}"], z[f"topk_logits_{i}"], z[f"full_pos_{i}"], z[f"full_logits_{i}"])
            for i in range(3)]


@pytest.fixture(scope="module")
def fp32_logits(engine_for):
    eng = engine_for("fp32", max_context=1024)
    return [eng.score(ids) for ids, *_ in _texts("llama_f32_logits.npz")]


def _assert_f32_agreement(logits, fixture: str):
    """Our logits (one (n, vocab) array a text) against llama.cpp's on the F32 copy: within
    1e-3 on its top 32 and its full rows, and the same top-1 at >= 99.5% of the positions."""
    n = agree = 0
    for ours, (ids, top_ids, top_logits, full_pos, full) in zip(logits, _texts(fixture), strict=True):
        assert ours.shape == (len(ids), 49152) and ours.dtype == np.float32
        np.testing.assert_allclose(np.take_along_axis(ours, top_ids, axis=1), top_logits, atol=1e-3, rtol=0)
        np.testing.assert_allclose(ours[full_pos], full, atol=1e-3, rtol=0)
        n += len(ids)
        agree += int((ours.argmax(1) == top_ids[:, 0]).sum())
    assert n >= 300
    assert agree / n >= 0.995


@pytest.mark.model
def test_matches_llama_cpp_f32_within_1e_3(fp32_logits):
    _assert_f32_agreement(fp32_logits, "llama_f32_logits.npz")


@pytest.mark.model
def test_ranking_agrees_with_llama_cpp_q4_1(fp32_logits):
    """llama.cpp's own F32 and Q4_1 runs agree on 98.5% of top-1 here; we ask >= 95%."""
    n = agree = 0
    for ours, (ids, top_ids, *_rest) in zip(fp32_logits, _texts("llama_q4_1_logits.npz")):
        n += len(ids)
        agree += int((ours.argmax(1) == top_ids[:, 0]).sum())
    assert agree / n >= 0.95


def _values(model: GGUFModel, name: str) -> np.ndarray:
    """A tensor's weights as float32, numpy (reversed ggml ne) order, read through the
    loader: a 3-D expert tensor as its experts' matrices, anything else as rows."""
    t = model.tensors[name]
    ne = [int(n) for n in t.shape]
    if len(ne) == 3:
        return np.stack([dequantize(q.raw, q.qtype) for q in model.experts(name, ne[2], ne[1], ne[0])])
    q = model.tensor(name)
    return dequantize(q.raw, q.qtype).reshape(tuple(reversed(ne)))


def test_f32_copy_of_an_moe_file_keeps_every_tensor(tiny_model, tmp_path):
    """tools/write_f32_gguf.py makes the files llama.cpp's F32 fixtures come from: an MoE
    file's 3-D expert tensors keep their ggml order (ne [d, ff, E] for gate and up, [ff, d, E]
    for down) and its F32 router stays as it is, every weight equal to the quantized one."""
    moe = moefy(tiny_model, tmp_path / "moe.gguf", "split", experts=2, used=1, router="random", seed=0)
    f32 = tmp_path / "moe.F32.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "write_f32_gguf.py"), str(moe), str(f32)],
                   check=True, capture_output=True)
    src, copy = GGUFModel(moe), GGUFModel(f32)
    assert copy.config == src.config and src.config.n_expert == 2
    assert copy.metadata("general.file_type") == 0  # ALL_F32
    assert list(copy.tensors) == list(src.tensors)
    d, ff = src.config.d_model, src.config.d_ff
    ne = {n: [int(x) for x in t.shape] for n, t in src.tensors.items()}
    assert ne["blk.0.ffn_gate_exps.weight"] == ne["blk.0.ffn_up_exps.weight"] == [d, ff, 2]
    assert ne["blk.0.ffn_down_exps.weight"] == [ff, d, 2] and ne["blk.0.ffn_gate_inp.weight"] == [d, 2]
    assert {t.tensor_type.name for t in src.tensors.values()} > {"F32"}  # something was dequantized
    for name, t in copy.tensors.items():
        assert t.tensor_type.name == "F32" and [int(x) for x in t.shape] == ne[name], name
        np.testing.assert_array_equal(_values(copy, name), _values(src, name), err_msg=name)


def _moe_logits(which: str, model_path: str, folder: Path):
    """Our logits over the three texts on the MoE file `which` ("oracle" or "routed"),
    rebuilt from the default model with the moefy settings its fixture was made from."""
    entry = MOE_META["files"][which]
    settings = entry["moefy"]
    path = moefy(model_path, folder / f"{which}.gguf", **settings)
    eng = Engine.load(model=str(path), kv="fp32", device="cpu", max_context=1024)
    assert (eng.config.n_expert, eng.config.n_expert_used) == (settings["experts"], settings["used"])
    return [eng.score(ids) for ids, *_ in _texts(entry["fixture"])]


@pytest.mark.model
def test_moe_oracle_matches_llama_cpp_f32_within_1e_3(default_model_path, tmp_path):
    """Split into 8 experts, all used, zero router: the dense model with its sums in another
    order, in llama.cpp as here (llama.cpp's oracle and dense runs differ by 6e-5)."""
    _assert_f32_agreement(_moe_logits("oracle", default_model_path, tmp_path), "llama_moe_oracle_logits.npz")


@pytest.mark.model
def test_moe_routing_matches_llama_cpp_f32_within_1e_3(default_model_path, tmp_path):
    """6 of 8 experts by a random router: softmax over the 8 logits, top 6, the 6 weights
    renormalized. One expert chosen differently at one token of one layer moves the logits
    far past 1e-3, and the file is not the dense model: llama.cpp's routed and dense runs
    share the top-1 at fewer than a fifth of the positions, so only the same routing agrees."""
    against_dense = MOE_META["against_llama_cpp_dense_f32"]["routed"]
    agree, n = map(int, against_dense["top1_agreement"].split("/"))
    assert agree / n < 0.2 and against_dense["max_abs_diff_full_rows"] > 1.0
    _assert_f32_agreement(_moe_logits("routed", default_model_path, tmp_path), "llama_moe_routed_logits.npz")
