"""Every way a model file can be wrong gets one clear error (and exit 2 from the CLI)."""
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_nb.cli import main
from strata_nb.errors import StrataError
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.synthetic import write_synthetic_gguf


def test_missing_file(tmp_path):
    with pytest.raises(StrataError, match="not found"):
        GGUFModel(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    with pytest.raises(StrataError, match="not a GGUF"):
        GGUFModel(p)


def test_truncated_header(tiny_model, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(Path(tiny_model).read_bytes()[:200])
    with pytest.raises(StrataError, match="truncated or corrupt: its header does not read"):
        GGUFModel(p)


@pytest.mark.parametrize("file, cut_in", [("tiny_model", "blk.0.ffn_up.weight"), ("tiny_model", "the last tensor"),
                                          ("k_quant_model", "blk.0.attn_v.weight")])
def test_truncated_tensor_data_names_the_tensor_and_the_missing_bytes(file, cut_in, request, tmp_path):
    model = request.getfixturevalue(file)
    data = Path(model).read_bytes()
    tensors = sorted(GGUFModel(model).reader.tensors, key=lambda t: t.data_offset)
    if cut_in == "the last tensor":
        name, end = tensors[-1].name, len(data) - 1
    else:
        name, end = cut_in, next(t.data_offset for t in tensors if t.name == cut_in) + 1
        assert file == "tiny_model" or next(t.tensor_type for t in tensors if t.name == cut_in).name == "Q4_K"
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:end])
    with pytest.raises(StrataError) as err:
        GGUFModel(p)
    assert str(err.value) == (f"{p} is truncated: tensor {name} runs past the end of the file, "
                              f"which lacks {len(data) - end:,} of its {len(data):,} bytes")


def test_unsupported_architecture(tmp_path):
    p = write_synthetic_gguf(tmp_path / "m.gguf", architecture="mamba", n_layers=1)
    with pytest.raises(StrataError, match="unsupported architecture 'mamba': strata-nb runs llama, gemma3"):
        GGUFModel(p)


def test_a_gemma3_file_without_its_window_or_norms(tmp_path, capsys):
    """A gemma3 file lacking its sliding window stops at open; one lacking a QK-norm at load,
    naming what is missing, from the CLI with exit 2 and no traceback."""
    p = write_synthetic_gguf(tmp_path / "g.gguf", architecture="gemma3", n_layers=6, d_model=64, d_ff=96)
    no_window = tmp_path / "no-window.gguf"
    data = bytearray(p.read_bytes())
    key = b"gemma3.attention.sliding_window"
    at = data.find(key)
    data[at:at + len(key)] = b"gemma3.attention.sliding_windoX"  # the key renamed: absent to the reader
    no_window.write_bytes(bytes(data))
    with pytest.raises(StrataError, match="GGUF metadata lacks 'gemma3.attention.sliding_window'"):
        GGUFModel(no_window)
    no_norm = tmp_path / "no-norm.gguf"
    data = bytearray(p.read_bytes())
    at = data.find(b"blk.0.attn_q_norm.weight")
    data[at:at + 24] = b"blk.0.attn_q_norX.weight"
    no_norm.write_bytes(bytes(data))
    from cli_runner import run_cli

    code, _, err = run_cli(["run", "--model", str(no_norm), "--device", "cpu", "--raw", "hi"], capsys)
    assert code == 2 and "lacks tensor 'blk.0.attn_q_norm.weight'" in err and "Traceback" not in err


def test_unsupported_tensor_type(tmp_path):
    q3k = np.zeros((4, 110), np.uint8)  # 4 rows of one 256-value Q3_K super-block each
    p = write_synthetic_gguf(tmp_path / "m.gguf", n_layers=1,
                             extra_tensor=("blk.0.extra.weight", q3k, gguf.GGMLQuantizationType.Q3_K))
    with pytest.raises(StrataError, match="Q3_K.*supported: F32, F16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        GGUFModel(p)


def test_missing_tensor(tiny_model):
    with pytest.raises(StrataError, match="lacks tensor 'blk.7.attn_q.weight'"):
        GGUFModel(tiny_model).tensor("blk.7.attn_q.weight")


@pytest.mark.parametrize("make", ["missing", "notgguf", "truncated header", "truncated data"])
def test_cli_bad_model_is_one_line_exit_2(make, tiny_model, tmp_path, capsys):
    p = tmp_path / "m.gguf"
    if make == "notgguf":
        p.write_text("not a model")
    elif make == "truncated header":
        p.write_bytes(Path(tiny_model).read_bytes()[:5000])
    elif make == "truncated data":
        p.write_bytes(Path(tiny_model).read_bytes()[:-1000])
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", str(p), "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("strata-nb: error:")


def test_head_dim_outside_the_rotation_width_is_one_line_exit_2(tmp_path, capsys):
    p = write_synthetic_gguf(tmp_path / "m.gguf", n_layers=1, head_dim=48)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", str(p), "--device", "cpu", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["strata-nb: error: head_dim 48 is not a multiple of 64 (the rotation width)"]


@pytest.mark.parametrize("shapes, qsa, message", [
    (dict(n_heads=9, n_kv_heads=1), 0, "at most 8 query heads per KV head; this model has head_dim 64 and 9"),
    (dict(n_heads=9, n_kv_heads=9), 256, "at most 8 KV heads, 8 query heads each, head_dim in "
                                         r"\(32, 64, 128, 256\); this model has 9, 1 and 64"),
])
def test_shapes_the_cuda_kernels_are_not_built_for(tmp_path, shapes, qsa, message):
    from strata_nb.engine.engine import Engine

    p = write_synthetic_gguf(tmp_path / "m.gguf", n_layers=1, **shapes)
    with pytest.raises(StrataError, match=message):
        Engine.load(model=str(p), device="cuda", qsa_budget=qsa)  # the simulator under the tests
    Engine.load(model=str(p), device="cpu", qsa_budget=qsa)  # the references take them
