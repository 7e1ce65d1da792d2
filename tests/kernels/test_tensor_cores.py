"""Tensor cores (fast/tensor_core.py) and the prompt kernels built on them (matmul_mma.py,
attention_prefill_mma.py): the fragment table against a plain matrix product, one warp's
product in a kernel, the reductions over a group of 4 lanes, then each kernel against its
reference, the attention's rows standing alone, and which kernels a prompt chunk runs.
Under the simulator the product is emulated from the same table; on a GPU it is the
mma.sync instruction, so the same tests check the table against the hardware."""
import numpy as np
import pytest
from numba import cuda

from attention_cases import GARBAGE_READS, HEAD_DIM, N_HEADS, N_KV, PAGE_TABLE, WRITTEN, filled_cache, run
from strata_nb.gpu.reduce import quad_max, quad_sum
from conftest import ON_GPU
from strata_nb.fast import tensor_core
from strata_nb.fast.tensor_core import PLACES, TILE_K, TILE_M, TILE_N, fragment_places, mma_f32, mma_ref
from strata_nb.fast import attention_prefill, attention_prefill_mma as mma_prompt
from strata_nb.fast.attention import attention
from strata_nb.fast.matmul_mma import matmul_mma
from strata_nb.kernels.attention.attention import ATOL, RTOL, attention_ref
from strata_nb.kernels.dense.matmul import matmul, matmul_ref
from strata_nb.kernels.dense.matvec import dot_tolerance
from strata_nb.kv_layout import all_blocks_upto, shared_blocks_upto
from strata_nb.model.dequant import dequantize
from test_dense_kernels import MATMUL_CASES, check_product, quantized, within

pytestmark = GARBAGE_READS  # the attention cases' unwritten cells (attention_cases.py)


def fragments_of(a, b, c):
    """(32, 10): each lane's a0..a3, b0, b1, c0..c3 of A (16 x 8), B (8 x 8), C (16 x 8)."""
    return np.array([[a[p] for p in places["a"]] + [b[p] for p in places["b"]] + [c[p] for p in places["c"]]
                     for places in PLACES], np.float32)


def matrix_of(d_fragments):
    """(32, 4) lanes' d0..d3 -> D (16 x 8)."""
    d = np.full((TILE_M, TILE_N), np.nan, np.float32)
    for places, values in zip(PLACES, d_fragments):
        for p, v in zip(places["c"], values):
            d[p] = v
    return d


def operands(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((TILE_M, TILE_K), np.float32), rng.standard_normal((TILE_K, TILE_N), np.float32),
            rng.standard_normal((TILE_M, TILE_N), np.float32))


def test_the_fragments_place_every_value_once():
    """The PTX manual's table for m16n8k8: 32 lanes x 4 registers cover A's 16 x 8 and C's
    16 x 8, 32 x 2 cover B's 8 x 8, each place once; a row of C lies in one group of 4 lanes."""
    for name, shape in (("a", (TILE_M, TILE_K)), ("b", (TILE_K, TILE_N)), ("c", (TILE_M, TILE_N))):
        places = [p for lane in range(32) for p in fragment_places(lane)[name]]
        assert sorted(places) == [(r, c) for r in range(shape[0]) for c in range(shape[1])], name
    for r in range(TILE_M):
        assert {lane // 4 for lane in range(32) for p in fragment_places(lane)["c"] if p[0] == r} == {r % 8}


def test_mma_ref_is_the_matrix_product():
    a, b, c = operands()
    want = (a.astype(np.float64) @ b + c).astype(np.float32)
    assert np.array_equal(matrix_of(mma_ref(fragments_of(a, b, c))), want)
    # the table matters: B read as if transposed is another product
    assert not np.allclose(matrix_of(mma_ref(fragments_of(a, b.T.copy(), c))), want, atol=1e-3)


@cuda.jit
def product_kernel(fragments, out):
    t = cuda.threadIdx.x
    f = fragments[t % 32]
    d0, d1, d2, d3 = mma_f32(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9])
    out[t, 0], out[t, 1], out[t, 2], out[t, 3] = d0, d1, d2, d3


def test_one_warp_product_in_a_kernel_to_float32_precision():
    """mma_f32 in a kernel, two warps each computing the same product: D = A B + C within
    float32's precision of the float64 product (on a GPU, three TF32 products; one would
    miss by ~1e-3)."""
    a, b, c = operands(1)
    a[3] *= 1000  # a row of large values: the split keeps their low bits
    out = np.zeros((64, 4), np.float32)
    product_kernel[1, 64](fragments_of(a, b, c), out)
    want = a.astype(np.float64) @ b + c
    for w in range(2):
        np.testing.assert_allclose(matrix_of(out[32 * w:32 * (w + 1)]), want, rtol=2e-6,
                                   atol=2e-6 * np.abs(a).max() * np.abs(b).max())


@cuda.jit
def quad_kernel(values, sums, maxes):
    t = cuda.threadIdx.x
    sums[t] = quad_sum(values[t])
    maxes[t] = quad_max(values[t])


def test_quad_reductions_give_each_group_its_own():
    values = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    sums, maxes = np.zeros(64, np.float32), np.zeros(64, np.float32)
    quad_kernel[1, 64](values, sums, maxes)
    groups = values.reshape(16, 4)
    want = (groups[:, 0] + groups[:, 1]) + (groups[:, 2] + groups[:, 3])  # the shuffles' order
    assert np.array_equal(sums, np.repeat(want, 4))
    assert np.array_equal(maxes, np.repeat(groups.max(axis=1), 4))


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype, n, shape", MATMUL_CASES)
def test_the_tensor_core_matmul_matches_the_reference(qtype, n, shape):
    """Every weight type, tiles of W and of x cut short (64 x 64 on a GPU, 32 x 32 under the
    simulator), within the plain kernel's bound (matvec.dot_tolerance) of the reference, and
    of its plain twin (kernels/dense/matmul.py): each sums the same products, in another
    order, within (in + 1) u sum |x w| of the exact sums, so not the plain kernel's bits."""
    check_product(matmul_mma, qtype, n, shape, matmul_ref)
    check_product(matmul_mma, qtype, n, shape, matmul)


@pytest.mark.fast_twin
def test_split_sums_have_the_unsplit_bits():
    """`in` cut into segments (160 values: 2 of 64 and a short one of 32), each on its own
    thread block and added up by sum_segments_kernel, gives the bits of one thread block
    walking them all; and a row's bits do not depend on the rows beside it (rows alone)."""
    from strata_nb.fast import matmul_mma as mm

    qtype, n, shape = "Q4_1", 20, (37, 160)
    n_segments = -(-shape[1] // (32 * mm.SEGMENT_BLOCKS))
    assert n_segments == 3 and shape[1] % (32 * mm.SEGMENT_BLOCKS)
    rng = np.random.default_rng(9)
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    whole, split = (np.full((n, shape[0]), np.nan, np.float32) for _ in range(2))
    matmul_mma(x, raw, qtype, whole, splits=1)
    matmul_mma(x, raw, qtype, split, splits=n_segments)
    assert np.array_equal(split, whole)
    alone = np.full((3, shape[0]), np.nan, np.float32)
    matmul_mma(x[7:10].copy(), raw, qtype, alone, splits=n_segments)
    assert np.array_equal(alone, whole[7:10])
    want = np.zeros((n, shape[0]), np.float32)
    matmul_ref(x, raw, qtype, want)
    assert within(whole, want, dot_tolerance(x, dequantize(raw, qtype)))
    with pytest.raises(AssertionError, match="one per segment"):
        matmul_mma(x, raw, qtype, split, splits=2)


@pytest.mark.fast_twin
@pytest.mark.skipif(ON_GPU, reason="the GPU's tensor cores cannot be handed a wrong table")
def test_a_wrong_fragment_table_is_caught(monkeypatch):
    """Negative control: B's places read transposed (row t, column g taken as row g,
    column t) in the simulator's product, and the matmul misses the tolerance."""
    qtype, n, shape = MATMUL_CASES[0]
    rng = np.random.default_rng(8)
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    want, got = np.zeros((n, shape[0]), np.float32), np.full((n, shape[0]), np.nan, np.float32)
    matmul_ref(x, raw, qtype, want)
    rows, cols = tensor_core._INDEX["b"]
    monkeypatch.setitem(tensor_core._INDEX, "b", (cols, rows))
    matmul_mma(x, raw, qtype, got)
    assert not within(got, want, dot_tolerance(x, dequantize(raw, qtype)))


@pytest.mark.fast_twin
@pytest.mark.parametrize("fmt, form", [("fp16", all_blocks_upto),
                                       pytest.param("k8v4", shared_blocks_upto, marks=pytest.mark.slow)])
def test_the_tensor_core_prompt_kernel_matches_the_reference(fmt, form):
    """A prompt chunk's 13 queries in tiles of 5 (the last of 3), three splits of 2 blocks
    merged by 4 combine rows: per-query rows (fp16) and one shared row (k8v4; 13 s under
    the simulator, so in the slow tier: the rows-alone test reads a shared row of k8v4 in
    the default one), blocks from the pool and from the host copy, garbage past the last
    written cell."""
    q_pos = np.arange(WRITTEN - 13, WRITTEN, dtype=np.int32)
    q = np.random.default_rng(3).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    assert mma_prompt.most_queries(N_HEADS // N_KV) >= 5
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, q, q_pos, form(q_pos), PAGE_TABLE, pool, host)
    want = run(attention_ref, *args)
    got = run(lambda *a: attention(*a, per_split=2, combine_groups=4, tile=5, mma=True), *args)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_rows_alone_on_tensor_cores(monkeypatch):
    """A query's bits do not depend on its chunk (attention_prefill.attention_prompt's
    rows_alone): 86..90 alone and as the last 5 of 78..90, splits of 4 blocks from block 0."""
    monkeypatch.setattr(attention_prefill, "ALONE_BLOCKS_PER_SPLIT", 4)
    fmt = "k8v4"
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q_pos = np.arange(78, 91, dtype=np.int32)
    q = np.random.default_rng(5).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    chunk = run(lambda *a: attention(*a, rows_alone=True, mma=True), fmt, q, q_pos, shared_blocks_upto(q_pos),
                PAGE_TABLE, pool, host)[8:]
    five = run(lambda *a: attention(*a, rows_alone=True, mma=True), fmt, q[8:], q_pos[8:],
               shared_blocks_upto(q_pos[8:]), PAGE_TABLE, pool, host)
    np.testing.assert_array_equal(chunk, five)


@pytest.mark.fast_twin
def test_which_prompt_kernel_runs(monkeypatch):
    """tensor_core.enabled() picks the tensor-core kernel where it is built; elsewhere the
    plain one runs, and asking for it outright is an error that says why."""
    assert mma_prompt.usable(HEAD_DIM) == ""
    assert "head_dim 128" in mma_prompt.usable(128)
    q_pos = np.arange(WRITTEN - 3, WRITTEN, dtype=np.int32)
    q = np.random.default_rng(6).standard_normal((3, N_HEADS, HEAD_DIM), np.float32)
    pool, host = filled_cache("fp16", PAGE_TABLE, n_slots=4)
    args = ("fp16", q, q_pos, all_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    runs = []
    monkeypatch.setattr(mma_prompt, "MMA_KERNELS", {k: _Recording(v, runs) for k, v in mma_prompt.MMA_KERNELS.items()})
    monkeypatch.setattr(tensor_core, "_ON", False)  # the simulator's default; a GPU's is on
    run(attention, *args)
    assert runs == []
    monkeypatch.setattr(tensor_core, "_ON", True)
    run(attention, *args)
    assert runs == [("fp16", HEAD_DIM)]
    monkeypatch.setattr(mma_prompt, "MMA_HEAD_DIMS", ())
    with pytest.raises(AssertionError, match="no tensor-core prompt kernel"):
        run(lambda *a: attention(*a, mma=True), *args)


class _Recording:
    """A kernel that notes each launch (by its key in `table`) and runs it."""

    def __init__(self, kernel, runs, table=None):
        self.kernel, self.runs, self.table = kernel, runs, table

    def __getitem__(self, config):
        launch = self.kernel[config]

        def call(*args):
            table = mma_prompt.MMA_KERNELS if self.table is None else self.table
            self.runs.append(next(k for k, v in table.items() if v is self or v is self.kernel))
            return launch(*args)
        return call


def test_the_backends_say_which_prompt_kernel_runs(monkeypatch):
    """What `run --stats` and the bench JSON report (`prompt_kernels`)."""
    from strata_nb.fast.backend import FastCudaBackend
    from strata_nb.backend.numpy_backend import NumpyBackend

    monkeypatch.setattr(tensor_core, "_ON", False)  # the simulator's default; a GPU's is on
    assert FastCudaBackend().prompt_kernels(HEAD_DIM) == "plain"
    monkeypatch.setattr(tensor_core, "_ON", True)
    assert FastCudaBackend().prompt_kernels(HEAD_DIM) == "tensor cores"
    assert FastCudaBackend().prompt_kernels(128) == ("tensor cores for the matmuls, plain attention "
                                                 "(head_dim 128 is not one of (64,))")
    assert NumpyBackend().prompt_kernels(HEAD_DIM) == "reference"


@pytest.mark.sim_engine  # the tiny model's 10-token prefill on both engines: ~9 s under the simulator
def test_a_prefill_on_tensor_cores_matches_the_numpy_engine(tiny_model, monkeypatch):
    """With tensor cores on, the cuda engine's prompt chunk runs its matmuls and its
    attention on tensor cores (the attention in 2 tiles of the tiny model's 10 queries x 2
    heads), and every prompt position's logits stay within test_cuda_backend_forward's
    bound of the numpy engine's."""
    from test_cuda_backend_forward import PROMPT, assert_logits_close
    from strata_nb.fast.backend import FastCudaBackend
    from strata_nb.backend.numpy_backend import NumpyBackend
    from strata_nb.engine.engine import Engine
    from strata_nb.fast import matmul_mma as mm
    from strata_nb.model.gguf_file import GGUFModel
    from strata_nb.settings import Settings

    runs, products = [], []
    monkeypatch.setattr(tensor_core, "_ON", True)
    monkeypatch.setattr(mma_prompt, "MMA_KERNELS", {k: _Recording(v, runs) for k, v in mma_prompt.MMA_KERNELS.items()})
    monkeypatch.setattr(mm, "MATMUL_MMA_KERNELS", {k: _Recording(v, products, mm.MATMUL_MMA_KERNELS)
                                                   for k, v in mm.MATMUL_MMA_KERNELS.items()})
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu")
    model = GGUFModel(tiny_model)
    want = Engine(settings, model, NumpyBackend()).score(PROMPT)
    got = Engine(settings, model, FastCudaBackend()).score(PROMPT)
    assert set(runs) == {("fp16", 64)} and len(runs) == 2  # one launch per layer
    assert {"Q4_1", "Q8_0"} <= set(products)  # the layers' matrices and the tied output head
    for row_got, row_want in zip(got, want):
        assert_logits_close(row_got, row_want)


@pytest.mark.skipif(ON_GPU, reason="the simulator's shared memory")
def test_lanes_that_first_ask_at_once_share_one_scratch(monkeypatch):
    """The simulator's shared.array looks its array up by the calling line and adds it when
    missing. Threads released together by a barrier can all miss, and each make its own:
    this stand-in widens that gap to 20 ms. The emulated product and the quad reductions
    ask under one lock (reduce.first_ask), so every lane still trades with its warp; the
    negative control, without the lock, gets wrong sums."""
    import contextlib
    import sys
    import time
    import traceback

    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    from strata_nb.gpu import reduce

    def slow_array(self, shape, dtype, alignment=None):
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        found = self._allocations.get(caller)
        if found is None:
            time.sleep(0.02)  # the gap between the lookup and the store, widened
            found = self._allocations[caller] = np.zeros(shape, numpy_support.as_dtype(dtype))
        return found

    monkeypatch.setattr(kernelapi.FakeCUDAShared, "array", slow_array)
    values = np.random.default_rng(9).standard_normal(64).astype(np.float32)
    want = np.repeat(values.reshape(16, 4).sum(axis=1), 4)
    a, b, c = operands(4)
    for lock, ok in ((reduce.first_ask, True), (contextlib.nullcontext(), False)):
        monkeypatch.setattr(reduce, "first_ask", lock)
        monkeypatch.setattr(tensor_core, "first_ask", lock)
        sums, maxes, out = np.zeros(64, np.float32), np.zeros(64, np.float32), np.zeros((32, 4), np.float32)
        quad_kernel[1, 64](values, sums, maxes)
        product_kernel[1, 32](fragments_of(a, b, c), out)
        assert np.allclose(sums, want, atol=1e-5) == ok
        assert np.allclose(matrix_of(out), a.astype(np.float64) @ b + c, atol=1e-4) == ok
