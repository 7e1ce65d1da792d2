"""The references give a verify window's row the decode step's bits: each row (each query)
of a call with several rows equals, byte for byte, the same row in a call of its own. The
numpy backend composes these references, so its --spec is --spec 0 token for token and
cell for cell (tests/test_speculation.py). Only references run here: no kernel."""
import numpy as np
import pytest

from attention_cases import PAGE_TABLE, filled_cache, queries, run
from kernels.test_dense_kernels import quantized
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kernels.attention.attention import attention_ref
from strata_nb.fast.matvec_fused import matvec_fused_ref
from strata_nb.kernels.dense.matvec import MAX_ROWS, product_ref
from strata_nb.kernels.experts.expert_down import expert_down_ref
from strata_nb.kernels.experts.expert_gate_up import expert_gate_up_ref
from strata_nb.kernels.experts.moe import moe_ffn_ref
from strata_nb.kernels.experts.route import route_ref
from strata_nb.kernels.kv.quant_q4_0 import quantize_q4_0_ref
from strata_nb.kernels.step.block_scores import block_scores_ref
from strata_nb.kv_layout import FORMATS

rng = np.random.default_rng(11)


def each_alone(f, n):
    """f(rows) for every row i alone (rows = slice(i, i + 1)), stacked: the decode steps."""
    return np.concatenate([f(slice(i, i + 1)) for i in range(n)])


def same_bytes(a, b):
    assert a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n_in, n_out", [(576, 1728), (1536, 576), (64, 49)])
def test_a_product_s_row_is_the_same_alone_or_in_a_window(n_in, n_out):
    x = rng.standard_normal((MAX_ROWS, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    for n in range(2, MAX_ROWS + 1):
        same_bytes(product_ref(x[:n], w), each_alone(lambda r: product_ref(x[r], w), n))
    same_bytes(NumpyBackend().matmul(x, w), product_ref(x, w))
    more = rng.standard_normal((MAX_ROWS + 3, n_in)).astype(np.float32)  # a prompt chunk: one product
    same_bytes(product_ref(more, w), more @ w.T)


def test_matvec_fused_ref_s_row_is_the_same_alone_or_in_a_window():
    """The fused forms too: the norm before, the residual add after."""
    n, n_in, n_out = 5, 256, 96
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    raw = quantized(rng, "Q8_0", (n_out, n_in))
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    y0 = rng.standard_normal((n, n_out)).astype(np.float32)

    def product(rows):
        y = y0[rows].copy()
        matvec_fused_ref(x[rows], raw, "Q8_0", y, norm=norm, eps=1e-5, add=True)
        return y
    same_bytes(product(slice(0, n)), each_alone(product, n))


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_s_query_is_the_same_alone_or_in_a_window(fmt):
    """Eight queries at consecutive positions, each with its own selection (some blocks
    shared, some not); the cells after a query's position are written, as a window's
    later rows write them, and unwritten garbage lies beyond."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q, q_pos, blocks = queries(8)
    together = run(attention_ref, fmt, q, q_pos, blocks, PAGE_TABLE, pool, host)
    alone = each_alone(lambda r: run(attention_ref, fmt, q[r], q_pos[r], blocks[r], PAGE_TABLE, pool, host), 8)
    assert np.isfinite(together).all()
    same_bytes(together, alone)


def test_block_scores_of_a_query_are_the_same_alone_or_in_a_window():
    n_q, n_heads, hd, n_kv, n_blocks, window = 5, 9, 64, 3, 12, 2
    positions = np.arange(150, 150 + n_q, dtype=np.int32)  # crosses from block 9 into block 10
    q = rng.standard_normal((n_q, n_heads, hd)).astype(np.float32)
    sketch = quantize_q4_0_ref(rng.standard_normal((n_blocks, n_kv, 16, hd)).astype(np.float32))

    def scores(rows):
        out = np.zeros((len(positions[rows]), n_blocks), np.float32)
        block_scores_ref(q[rows], sketch, positions[rows], window, out)
        return out
    same_bytes(scores(slice(0, n_q)), each_alone(scores, n_q))


def test_an_moe_layer_s_row_is_the_same_alone_or_in_a_window():
    """The router, the experts' gate|up and down (several rows choose one expert), and the
    spec they compose to."""
    n, d, f, e, k = 6, 64, 32, 4, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = (0.3 * rng.standard_normal((e, d))).astype(np.float32)
    gate_up = rng.standard_normal((e, 2 * f, d)).astype(np.float32)
    down = rng.standard_normal((e, d, f)).astype(np.float32)
    res = np.array([0, -1, 1, -1], np.int32)  # experts 0 and 2 in slots 0 and 1
    slots_gu, slots_down = gate_up[[0, 2]], down[[0, 2]]

    def layer(rows):
        t = len(x[rows])
        out, x_norm = x[rows].copy(), np.empty((t, d), np.float32)
        chosen, weights, slot_of = np.empty((t, k), np.int32), np.empty((t, k), np.float32), np.empty((t, k), np.int32)
        route_ref(x[rows], norm, 1e-5, router, x_norm, chosen, weights, slot_of, res, 0, np.zeros(e, np.int32),
                  np.zeros(e, np.int32))
        h = np.empty((t, k, f), np.float32)
        expert_gate_up_ref(x_norm, chosen, res, 0, slots_gu, gate_up, h)
        expert_down_ref(h, chosen, weights, res, 0, slots_down, down, out)
        spec = moe_ffn_ref(x[rows].copy(), x_norm, router, list(gate_up), list(down), k)
        return np.concatenate([out, spec, chosen.view(np.float32)], axis=1)
    together = layer(slice(0, n))
    assert len(np.unique(together[:, -k:].view(np.int32))) < n * k  # rows share an expert
    same_bytes(together, each_alone(layer, n))
