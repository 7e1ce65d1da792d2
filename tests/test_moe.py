"""Mixture of experts on the numpy backend: `strata-nb moefy`'s files, the loader, and the
reference MoE FFN (kernels/experts/moe.py), on tiny random-weight models.

The split file with K = E and a zero router is the exact oracle: every expert weighs 1/E
and its down projection is scaled by E, so the layer computes the dense FFN's sums, only
in another order. Float32 sums in another order differ by a few units in the last place
per dot product; random weights amplify that through the layers, and the logits of these
tiny models move by up to ~2e-5 of the largest logit (the copies file, whose K weights sum
to 1 within rounding, as much). The tests allow 1e-4 of it. A wrong expert, slot or weight
moves them by whole units (the negative control swaps two experts' down rows).
"""
import gguf
import numpy as np
import pytest

from strata_nb import Engine
from strata_nb.errors import SettingError, StrataError
from strata_nb.kernels.experts.moe import moe_route_ref
from strata_nb.model.dequant import dequantize
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf
from cli_runner import run_cli

PROMPT = [5, 77, 130, 42, 9, 201, 66, 18]
REL = 1e-4  # of the largest logit: see the module docstring


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """dense(qtype) -> a 2-layer dense GGUF with d_ff 256: E = 2, 4, 8 split it into 32-multiples."""
    folder, made = tmp_path_factory.mktemp("moe"), {}

    def make(qtype="Q4_1"):
        if qtype not in made:
            made[qtype] = str(write_synthetic_gguf(folder / f"dense_{qtype}.gguf", d_ff=256, qtype=qtype, seed=3))
        return made[qtype]

    return make


def engine(path):
    return Engine.load(model=str(path), device="cpu", max_context=128)


def greedy(eng, n: int) -> list[int]:
    """n greedy tokens after PROMPT, stop tokens or not."""
    token, out = int(np.argmax(eng.prefill(PROMPT))), []
    for pos in range(len(PROMPT), len(PROMPT) + n):
        out.append(token)
        token = int(np.argmax(eng.decode_one_token(token, pos)))
    return out


def assert_logits_close(got, want):
    err = np.abs(got - want).max()
    assert err <= REL * np.abs(want).max(), (err, np.abs(want).max())


@pytest.mark.parametrize("experts, qtype", [(2, "Q4_1"), (4, "Q4_1"), (4, "Q8_0"), (8, "Q4_0")])
def test_split_all_experts_is_the_dense_model(experts, qtype, dense, tmp_path):
    moe_path = moefy(dense(qtype), tmp_path / "moe.gguf", "split", experts)
    base, moe = engine(dense(qtype)), engine(moe_path)
    assert (moe.config.n_expert, moe.config.n_expert_used, moe.config.d_ff) == (experts, experts, 256 // experts)
    ids = PROMPT * 4
    assert_logits_close(moe.score(ids), base.score(ids))
    assert greedy(moe, 64) == greedy(base, 64)


def test_negative_control_swapped_experts_break_the_oracle(dense, tmp_path):
    moe = engine(moefy(dense(), tmp_path / "moe.gguf", "split", 4))
    want = engine(dense()).score(PROMPT)
    slots = moe.weights.experts.slot_down  # every expert resident: layer 0's experts 0, 1 in slots 0, 1
    slots[[0, 1]] = slots[[1, 0]]
    assert np.abs(moe.score(PROMPT) - want).max() > 100 * REL * np.abs(want).max()


def test_copies_with_a_random_router_are_the_dense_model(dense, tmp_path):
    moe = engine(moefy(dense(), tmp_path / "copies.gguf", "copies", 8, used=2, seed=5))
    assert (moe.config.n_expert, moe.config.n_expert_used, moe.config.d_ff) == (8, 2, 256)
    for layer in moe.weights.layers:
        assert np.abs(layer.router).max() > 0  # a random router, not a zero one
    base, ids = engine(dense()), PROMPT * 4
    assert_logits_close(moe.score(ids), base.score(ids))
    assert greedy(moe, 64) == greedy(base, 64)
    # the router does choose among the copies: different tokens take different experts
    x = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    chosen = set(moe_route_ref(x, moe.weights.layers[0].router, 2)[0].ravel().tolist())
    assert len(chosen) > 2


def moe_loop_ref(x, x_norm, router, gate_up, down, k):
    """The MoE FFN token by token, in float64: each token's softmax, its top k, their
    renormalized weights, and the weighted sum of its experts."""
    out = np.array(x, np.float64)
    for t in range(len(x)):
        logits = router.astype(np.float64) @ x_norm[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        for e in top:
            g_u = gate_up[e].astype(np.float64) @ x_norm[t]
            g, u = g_u[:len(g_u) // 2], g_u[len(g_u) // 2:]
            out[t] += p[e] / sum(p[i] for i in top) * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_split_with_a_random_router_matches_a_per_token_loop(dense, tmp_path):
    moe = engine(moefy(dense(), tmp_path / "moe.gguf", "split", 4, used=2, seed=7))
    assert moe.config.n_expert_used == 2
    layer, eps = moe.weights.layers[1], moe.config.rms_eps
    rng = np.random.default_rng(11)
    x = rng.standard_normal((37, 128)).astype(np.float32)  # 37 tokens: every expert gets some
    experts, at = moe.weights.experts, moe.weights.experts.at(1)
    want = moe_loop_ref(x, moe.be.rmsnorm(x, layer.ffn_norm, eps), layer.router, experts.host_gate_up[at:at + 4],
                        experts.host_down[at:at + 4], 2)
    got = moe.be.moe_ffn_add_(x.copy(), layer.ffn_norm, eps, layer.router, experts, 1)
    # float32 against float64 over dot products of 128 and 64 terms: 1e-5 of the output's scale
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(got - x).max() > 0.1  # the experts did add something


def test_split_slices_the_dense_rows_byte_for_byte(dense, tmp_path):
    E, src = 4, GGUFModel(dense())
    moe = GGUFModel(moefy(dense(), tmp_path / "moe.gguf", "split", E, used=2, seed=1))
    ff_e = 256 // E
    for i in range(2):
        p = f"blk.{i}."
        gates = moe.experts(p + "ffn_gate_exps.weight", E, ff_e, 128)
        ups = moe.experts(p + "ffn_up_exps.weight", E, ff_e, 128)
        downs = moe.experts(p + "ffn_down_exps.weight", E, 128, ff_e)
        gate, up, down = (src.tensor(p + f"ffn_{w}.weight") for w in ("gate", "up", "down"))
        for e in range(E):
            rows = slice(e * ff_e, (e + 1) * ff_e)
            assert np.array_equal(gates[e].raw, gate.raw[rows]) and np.array_equal(ups[e].raw, up.raw[rows])
            blocks = downs[e].raw.reshape(128, -1, 20)  # Q4_1 blocks: d, m fp16, then 16 bytes of nibbles
            dense_blocks = down.raw[:, e * ff_e // 32 * 20:(e + 1) * ff_e // 32 * 20].reshape(128, -1, 20)
            assert np.array_equal(blocks[..., 4:], dense_blocks[..., 4:])  # the weights' nibbles, untouched
            # d and m scaled by E exactly, so every weight is E times the dense one
            assert np.array_equal(dequantize(downs[e].raw, "Q4_1"), E * dequantize(down.raw, "Q4_1")[:, rows])
        router = moe.tensors[p + "ffn_gate_inp.weight"]
        assert router.tensor_type.name == "F32" and router.shape.tolist() == [128, E]  # ggml ne [d, E]
        assert moe.tensors[p + "ffn_down_exps.weight"].shape.tolist() == [ff_e, 128, E]  # ne [ff_e, d, E]
        assert not moe.has(p + "ffn_gate.weight")
    for name, t in src.tensors.items():  # every other tensor copied as is
        if "ffn_" not in name or "norm" in name:
            assert np.array_equal(np.asarray(moe.tensors[name].data), np.asarray(t.data)), name
    assert moe.metadata("tokenizer.ggml.tokens") == src.metadata("tokenizer.ggml.tokens")


def test_copies_copy_every_dense_row(dense, tmp_path):
    src = GGUFModel(dense())
    moe = GGUFModel(moefy(dense(), tmp_path / "copies.gguf", "copies", 4))
    for w, rows, cols in (("gate", 256, 128), ("down", 128, 256)):
        for expert in moe.experts(f"blk.0.ffn_{w}_exps.weight", 4, rows, cols):
            assert np.array_equal(expert.raw, src.tensor(f"blk.0.ffn_{w}.weight").raw)


def test_cli_writes_the_file(dense, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    code, text, _ = run_cli(["moefy", "--model", dense(), "--experts", "4", "--out", str(out)], capsys)
    assert code == 0 and text.startswith(str(out)) and "MiB" in text
    assert GGUFModel(out).config.n_expert == 4


@pytest.mark.parametrize("d_ff, flags, message", [
    (256, ["--experts", "3"], "--experts 3 does not split the FFN's 256 columns into whole Q4_1 blocks of 32"),
    (256, ["--experts", "16"], "ff / E must be a multiple of 32); these do: 2, 4, 8"),
    (192, ["--experts", "3"], "--experts 3 is not a power of two"),
    (256, ["--experts", "4", "--used", "5"], "--used must be 1 .. the number of experts (4), got 5"),
    (256, ["--experts", "4", "--used", "2", "--router", "zero"], "--router zero ties every expert"),
    (256, ["--experts", "4", "--seed", "-1"], "--seed must be >= 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(d_ff, flags, message, dense, tiny_model, tmp_path, capsys):
    model = dense() if d_ff == 256 else tiny_model  # the tiny model's d_ff is 192
    code, _, err = run_cli(["moefy", "--model", model, "--out", str(tmp_path / "x.gguf")] + flags, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "x.gguf").exists()


def test_cli_out_in_a_missing_folder_is_one_line_and_exit_2(dense, tmp_path, capsys):
    out = tmp_path / "no" / "m.gguf"
    code, _, err = run_cli(["moefy", "--model", dense(), "--experts", "4", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"--out names a folder that does not exist: {out.parent}" in lines[0], err


def test_a_write_that_fails_leaves_the_file_that_was_there(dense, tmp_path, monkeypatch):
    """The file is written beside its name and renamed when whole: a failure halfway (a full
    disk) leaves what was at the name before, and no half file."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"the earlier file")

    def full_disk(self, tensor):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    with pytest.raises(StrataError, match="No space left on device"):
        moefy(dense(), out, "split", 4)
    assert out.read_bytes() == b"the earlier file" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def rewrite(src, dst, drop=(), changed=None):
    """A copy of the GGUF src without the tensors in `drop` and with `changed` {key: uint32}."""
    reader, changed = gguf.GGUFReader(src), dict(changed or {})
    w = gguf.GGUFWriter(str(dst), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, changed.pop(f.name, f.contents()), f.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("drop, changed, message", [
    (["blk.1.ffn_down_exps.weight"], None, "lacks tensor 'blk.1.ffn_down_exps.weight'"),
    ([], {"llama.expert_used_count": 5}, "routes each token to 5 of 4 experts"),
    ([], {"llama.expert_count": 8}, "tensor blk.0.ffn_gate_inp.weight has shape (4, 128); this model needs (8, 128)"),
])
def test_malformed_moe_file_is_one_clear_error(drop, changed, message, dense, tmp_path):
    moe_path = moefy(dense(), tmp_path / "moe.gguf", "split", 4)
    bad = rewrite(moe_path, tmp_path / "bad.gguf", drop, changed)
    with pytest.raises(StrataError) as err:
        engine(bad)
    assert message in str(err.value)


def test_api_errors_name_the_parameter(dense, tmp_path):
    with pytest.raises(SettingError, match="used must be 1 .. the number of experts"):
        moefy(dense(), tmp_path / "x.gguf", "split", 4, used=0)
    moe_path = moefy(dense(), tmp_path / "moe.gguf", "split", 2)
    with pytest.raises(StrataError, match="already a mixture of 2 experts"):
        moefy(moe_path, tmp_path / "again.gguf")


def test_cuda_backend_refuses_more_experts_than_its_router_holds(dense):
    from dataclasses import replace

    from strata_nb.fast.backend import FastCudaBackend

    cfg = GGUFModel(dense()).config
    with pytest.raises(StrataError, match="expert kernels take at most 64 experts, 8 a token and a model dim of "
                                          "8192; this model has 65, 2 and 128"):
        FastCudaBackend().check_model(replace(cfg, n_expert=65, n_expert_used=2), qsa=False)


@pytest.mark.slow
@pytest.mark.model
def test_default_model_split_8_of_8_is_the_dense_model(default_model_path, tmp_path):
    """The default model as 8 experts of 192 columns, all used: its first 16 greedy tokens
    are the dense model's."""
    moe = engine(moefy(default_model_path, tmp_path / "moe.gguf", "split", 8))
    assert (moe.config.n_expert, moe.config.d_ff) == (8, 192)
    assert greedy(moe, 16) == greedy(engine(default_model_path), 16)
