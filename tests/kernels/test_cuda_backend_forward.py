"""The cuda backend's forward pass against the numpy backend's, on the tiny synthetic model
(2 layers, d 128, ff 192, 2 heads, 1 KV head, hd 64, Q4_1 matrices, a Q8_0 tied head):
teacher-forced prompt logits, decode-step logits and greedy tokens. The simulator runs
it in CI, a GPU with STRATA_NB_GPU=1.

The prompt is 10 tokens, so prefill takes the tiled matmul (more than 8 rows) and each
decode step the matvec (1 row): both paths, every op, the fp16 KV cache in between.

Tolerance: each kernel is within its own written tolerance of its reference (about
1e-6 relative, test_dense_kernels.py), but the KV cache rounds K and V to fp16, and a
value that moved by 1e-6 can round to the neighbouring fp16 (2^-11 = 5e-4 relative).
A few such cells move an attention output by a fraction of that, and the logits follow.
So logits must agree within LOGIT_ATOL = 1e-3 of the largest logit: 50x the largest
difference seen under the simulator (2e-5), and over 100x below the smallest gap
between the top two logits of any position here (0.13 of the largest logit), so the
greedy tokens cannot flip within it.
"""
import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.backend import get_backend
from strata_nb.backend.cuda_backend import CudaBackend, DeviceMatrix
from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.engine import Engine
from strata_nb.errors import SettingError, StrataError
from strata_nb.model.gguf_file import GGUFModel, QTensor
from strata_nb.settings import Settings

PROMPT = [3 + ord(c) for c in "the cat sat"][:10]  # byte tokens (ids 0..2 are the specials)
DECODE_STEPS = 2
LOGIT_ATOL = 1e-3  # times the largest |logit| of the step


@pytest.fixture(scope="module")
def engines(tiny_model):
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu")
    model = GGUFModel(tiny_model)
    return Engine(settings, model, NumpyBackend()), Engine(settings, model, FastCudaBackend())


def assert_logits_close(got, want):
    bound = LOGIT_ATOL * np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= bound, f"logits differ by {err:.3g} > {bound:.3g}"


def test_weights_stay_quantized_on_the_device(engines):
    w = engines[1].weights
    assert isinstance(w.layers[0].wqkv, DeviceMatrix) and w.layers[0].wqkv.qtype == "Q4_1"
    assert w.layers[0].wqkv.shape == (2 * 64 + 2 * 64, 128)  # q (2 heads) | k | v, by d
    assert w.output is w.token_embd and w.token_embd.qtype == "Q8_0"


def test_matrix_stacks_rows_of_one_type_as_stored():
    """(Rows of mixed types are stored as F32: tests/test_dequant.py.)"""
    be = FastCudaBackend()
    q = QTensor("q", "Q8_0", (2, 32), np.arange(68, dtype=np.uint8).reshape(2, 34))
    k = QTensor("k", "Q8_0", (1, 32), np.full((1, 34), 7, np.uint8))
    m = be.matrix(q, k)
    assert (m.qtype, m.shape) == ("Q8_0", (3, 32))
    assert be.to_numpy(m.raw).tobytes() == np.concatenate([q.raw, k.raw]).tobytes()


def greedy(engine):
    """Teacher-forced prompt logits, then DECODE_STEPS greedy steps: (logits, tokens)."""
    prompt = engine.score(PROMPT)  # (10, vocab): every position's logits, through prefill
    logits, tokens = [prompt], [int(np.argmax(prompt[-1]))]
    for step in range(DECODE_STEPS):
        logits.append(engine.decode_one_token(tokens[-1], len(PROMPT) + step))
        tokens.append(int(np.argmax(logits[-1])))
    return logits, tokens


@pytest.mark.sim_engine  # ~30 s under the simulator, where every CUDA thread is a Python thread
def test_prefill_decode_and_greedy_tokens_match_numpy(engines):
    assert len(PROMPT) > 8  # prefill takes the matmul path
    (want, want_tokens), (got, got_tokens) = greedy(engines[0]), greedy(engines[1])
    assert got_tokens == want_tokens
    assert got[0].shape == want[0].shape == (len(PROMPT), engines[0].config.vocab_size)
    for g, w in zip(got, want):
        for row_got, row_want in zip(np.atleast_2d(g), np.atleast_2d(w)):
            assert_logits_close(row_got, row_want)


def test_get_backend_picks_cuda_only_where_it_runs(monkeypatch):
    import numba.cuda
    from numba import config

    assert isinstance(get_backend("cuda"), FastCudaBackend)  # a GPU, or the simulator; the fast tier by default
    plain = get_backend("cuda", "plain")
    assert isinstance(plain, CudaBackend) and not isinstance(plain, FastCudaBackend) and plain.kernels == "plain"
    assert isinstance(get_backend("cpu"), NumpyBackend)
    assert isinstance(get_backend("auto"), FastCudaBackend if ON_GPU else NumpyBackend)  # never the simulator
    monkeypatch.setattr(config, "ENABLE_CUDASIM", False)
    monkeypatch.setattr(numba.cuda, "is_available", lambda: False)  # a machine with no GPU
    with pytest.raises(SettingError, match="^device is cuda, which needs an NVIDIA GPU") as err:
        get_backend("cuda")
    assert err.value.flag == "--device"  # what the CLI names
    assert isinstance(get_backend("auto"), NumpyBackend)


def test_a_model_or_context_past_the_step_kernels_stops_before_any_launch():
    """check_model refuses what the step attention is not built for, with the range: a
    head_dim it has no kernel for, and a --max-context whose list has more splits than the
    merge keeps weights for. max_cells is exactly that bound: one block more and the
    launcher's assertion would fire at the first step."""
    from types import SimpleNamespace

    from strata_nb.fast import attention_step as st
    from strata_nb.kv_layout import BLOCK

    be, cfg = FastCudaBackend(), SimpleNamespace(arch="llama", head_dim=64, n_heads=8, n_kv_heads=2, n_expert=0)
    most = st.max_cells(64, 4)
    be.check_model(cfg, qsa=False, max_context=most)
    with pytest.raises(StrataError, match=f"at most {most:,} cells .*--max-context is {most + 1:,}"):
        be.check_model(cfg, qsa=False, max_context=most + 1)
    with pytest.raises(StrataError, match="built for head_dim"):
        be.check_model(SimpleNamespace(arch="llama", head_dim=96, n_heads=8, n_kv_heads=2, n_expert=0), qsa=False)
    per_split = min(st.STEP_BLOCKS_PER_SPLIT, st.split_fits(64))
    assert st.padded_splits(most // BLOCK, per_split, 64, 4) * 4 <= st.K_TILE_VALUES
    assert st.padded_splits(most // BLOCK + 1, per_split, 64, 4) * 4 > st.K_TILE_VALUES
