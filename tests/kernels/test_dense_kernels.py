"""The dense model kernels against their references: matvec and matmul within
dot_tolerance for every weight type, rmsnorm and swiglu within theirs, RoPE, the residual
add, embed and argmax bit for bit; the warp reductions against the butterfly order. Then
the fast tier's dense kernels (src/strata_nb/fast/): the fused matvec against its fused
reference, and each fast twin against its plain kernel.

Small, irregular shapes under the simulator (29 and 37 rows of W, 11/20/33 rows of x, a row
norm of 100 values); the default model's shapes with STRATA_NB_GPU=1. Same test bodies.
"""
import gguf
import numpy as np
import pytest
from numba import cuda, float32, uint32

from conftest import ON_GPU
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.fast import embed as fast_embed, matmul_tiled as fast_matmul, matvec_fused as fast_matvec
from strata_nb.fast.gguf_fetch import CODES, STEPS
from strata_nb.fast.matvec_fused import (AHEAD, SECTOR, fused_tolerance, matvec_fused, matvec_fused_ref, matvec_grid,
                                         read_ahead_ref)
from strata_nb.gpu.reduce import warp_max, warp_sum
from strata_nb.kernels.dense.embed import embed, embed_ref
from strata_nb.kernels.dense.gguf_rows import PART, PARTS, QTYPES as PARTS_OF, weight_views
from strata_nb.kernels.dense.matmul import TILE, matmul, matmul_ref
from strata_nb.kernels.dense.matvec import dot_tolerance, matvec, matvec_ref
from strata_nb.kernels.dense.residual import residual, residual_ref
from strata_nb.kernels.dense.rmsnorm import rmsnorm, rmsnorm_ref, rmsnorm_tolerance
from strata_nb.kernels.dense.rope import rope_qkv, rope_qkv_ref
from strata_nb.kernels.dense.swiglu import ATOL as SWIGLU_ATOL, RTOL as SWIGLU_RTOL, swiglu, swiglu_ref
from strata_nb.kernels.step.argmax import SPAN as ARGMAX_SPAN, THREADS as ARGMAX_THREADS, argmax, argmax_ref
from strata_nb.model.dequant import K_QUANT_F16, dequantize
from strata_nb.model.synthetic import random_k_quant_rows

QTYPES = ["Q4_0", "Q4_1", "Q8_0", "F32", "F16"]
# (out, in) of W: the default model's FFN and output head on a GPU; under the simulator
# 37 rows (not a multiple of the 4 rows a warp takes) of 3 quantization blocks.
MATVEC_SHAPES = [(1536, 576), (576, 1536), (49152, 576)] if ON_GPU else [(37, 96)]
# Every type at 1 row of x; 2, 3 and 8 rows for Q4_1, the default model's type, under the
# simulator, where each row of W costs ~2 ms a row of x: 2 rows a thread block (ROW_GROUP),
# so 3 leaves the second group's second row empty and 8 takes 4 groups.
MATVEC_CASES = [(q, n) for q in QTYPES for n in ((1, 2, 3, 8) if ON_GPU or q == "Q4_1" else (1,))]
# (qtype, rows of x, (out, in)). The plain kernel's tile is 64 rows of W x 64 of x on a
# GPU, 16 x 16 under the simulator (the tiled fast kernel's: 128 x 64, 8 x 16), and every
# case cuts a last tile short. Under the simulator: every type with 29 rows of W and 11
# of x (one tile of x, cut); 37 rows of W, 20 of x and 5 quantization blocks; 33 and 70
# rows of x; fewer rows of W than a tile holds. On a GPU, every type on 1000 rows of W
# (the last tile of 40) at 11 and 300 rows of x, and down's shape (576 x 1536) at 257.
MATMUL_CASES = ([(q, n, (1000, 576)) for q in QTYPES for n in (11, 300)] + [("Q4_1", 257, (576, 1536))]
                if ON_GPU else
                [(q, 11, (29, 96)) for q in QTYPES] + [("Q4_1", 20, (37, 160)), ("Q8_0", 33, (29, 96)),
                                                        ("Q4_0", 70, (67, 64)), ("F16", 5, (3, 32))])
N_ROWS = 67 if ON_GPU else 3  # activation rows for the elementwise kernels
D = 576 if ON_GPU else 100  # hidden size: 100 is not a multiple of the warp


def quantized(rng, qtype, shape, scale=0.1):
    """Random weights in GGUF form: (out, bytes_per_row) uint8 rows (the K-quants' random
    codes and scales: gguf-py cannot quantize to them)."""
    if qtype in K_QUANT_F16:
        return random_k_quant_rows(rng, qtype, shape[0], shape[1], scale)
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    if qtype == "F32":
        return w.view(np.uint8)
    if qtype == "F16":
        return w.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))


def within(got, want, bound) -> bool:
    return bool((np.abs(got.astype(np.float64) - want) <= bound).all())


def assert_within(got, want, bound):
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"off by up to {err.max():.3g}, {(err / bound).max():.3g} x the tolerance"


# ---- warp reductions -----------------------------------------------------------------------

@cuda.jit
def reduce_kernel(values, sums, maxes):
    t = cuda.grid(1)
    sums[t] = warp_sum(values[t])
    maxes[t] = warp_max(values[t])


def butterfly_sum(lanes):
    """The order five shfl_xor rounds add 32 values in (lane 0's view)."""
    lanes = lanes.copy()
    offset = 16
    while offset:
        lanes = lanes[:offset] + lanes[offset:2 * offset]
        offset //= 2
    return lanes[0]


def test_warp_sum_and_max_in_every_lane_in_butterfly_order():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(64) * np.float32(10.0) ** rng.integers(-3, 4, 64)).astype(np.float32)
    sums, maxes = np.zeros(64, np.float32), np.zeros(64, np.float32)
    reduce_kernel[1, 64](values, sums, maxes)
    for w in range(2):
        lanes = values[32 * w:32 * (w + 1)]
        assert (sums[32 * w:32 * (w + 1)] == butterfly_sum(lanes)).all()
        assert (maxes[32 * w:32 * (w + 1)] == lanes.max()).all()


# ---- matvec and matmul ---------------------------------------------------------------------

def check_product(launcher, qtype, n, shape, ref=matvec_ref):
    """launcher's y = x W^T (random W of qtype and shape, n random rows of x, seeded by n)
    within dot_tolerance of the reference's."""
    rng = np.random.default_rng(n)
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    want, got = np.zeros((n, shape[0]), np.float32), np.full((n, shape[0]), np.nan, np.float32)
    ref(x, raw, qtype, want)
    launcher(x, raw, qtype, got)
    assert_within(got, want, dot_tolerance(x, dequantize(raw, qtype)))


@pytest.mark.parametrize("shape", MATVEC_SHAPES)
@pytest.mark.parametrize("qtype, n", MATVEC_CASES)
def test_matvec_matches_ref(qtype, n, shape):
    check_product(matvec, qtype, n, shape)


# Q5_0 and Q5_1 (rows of any multiple of 32) and the K-quants (of 256), which the plain
# kernels read through gguf_rows.py's parts: 9 rows of W under the simulator, 2 super-blocks wide.
@pytest.mark.parametrize("qtype, shape", [("Q5_0", (9, 96)), ("Q5_1", (9, 96)), ("Q4_K", (9, 512)),
                                          ("Q5_K", (9, 512)), ("Q6_K", (9, 512))] if not ON_GPU else
                         [(q, (1536, 1536)) for q in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")])
def test_the_plain_matvec_reads_q5_and_the_k_quants(qtype, shape):
    check_product(matvec, qtype, 1, shape)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_plain_matmul_reads_the_k_quants(qtype):
    check_product(matmul, qtype, 5, (1000, 1536) if ON_GPU else (9, 512), matmul_ref)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_the_plain_embed_dequantizes_q5_and_the_k_quants_bit_for_bit(qtype):
    """A token's row, dequantized on the device, is the reference's to the bit: the
    K-quants' sub-block scale and its product with a code are exact in float32."""
    rng = np.random.default_rng(6)
    rows, d = (20, 96 if qtype in ("Q5_0", "Q5_1") else 512) if not ON_GPU else (4096, 1536)
    table = quantized(rng, qtype, (rows, d), scale=0.5)
    ids = rng.integers(0, rows, 6).astype(np.int32)
    want, got = np.zeros((len(ids), d), np.float32), np.full((len(ids), d), np.nan, np.float32)
    embed_ref(table, ids, want, qtype)
    embed(table, ids, got, qtype)
    assert got.tobytes() == want.tobytes()
    assert want.tobytes() == dequantize(table, qtype)[ids].tobytes()


@pytest.mark.parametrize("launch", [matvec, fast_matvec.matvec])
def test_matvec_tolerance_catches_one_zeroed_scale(launch):
    """Negative control: zero the scale d of one block of one row; the plain kernel's
    output, and its fast twin's, must leave the tolerance around the intact weights'
    reference."""
    rng = np.random.default_rng(7)
    out, n_in = MATVEC_SHAPES[0]
    raw = quantized(rng, "Q8_0", (out, n_in))
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    want, got = np.zeros((1, out), np.float32), np.zeros((1, out), np.float32)
    matvec_ref(x, raw, "Q8_0", want)
    broken = raw.copy()
    broken[5, 34:36] = 0  # d of block 1 of row 5 (fp16 0.0)
    launch(x, broken, "Q8_0", got)
    bound = dot_tolerance(x, dequantize(raw, "Q8_0"))
    assert not within(got, want, bound)
    keep = np.arange(out) != 5
    assert within(got[:, keep], want[:, keep], bound[:, keep])  # only row 5 moved


@pytest.mark.parametrize("qtype, n, shape", MATMUL_CASES)
def test_matmul_matches_ref(qtype, n, shape):
    assert n % TILE or shape[0] % TILE, "a case that fills its last tiles tests no edge"
    check_product(matmul, qtype, n, shape, matmul_ref)


@pytest.mark.parametrize("launch", [matmul, fast_matmul.matmul])
def test_matmul_tolerance_catches_one_wrong_scale(launch):
    """Negative control: one quantization block's scale zeroed in the kernel's copy of W
    (the last tile's last row, block 1) moves 32 products of one output column, and the
    test's tolerance sees it, for the plain kernel and its fast twin."""
    qtype, n, shape = "Q4_1", 20, MATMUL_CASES[-2][2]
    rng = np.random.default_rng(7)
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    want, got = np.zeros((n, shape[0]), np.float32), np.full((n, shape[0]), np.nan, np.float32)
    matmul_ref(x, raw, qtype, want)
    broken = raw.copy()
    broken[-1, 20:22] = 0  # block 1's fp16 d (Q4_1 blocks are d, m, 16 code bytes)
    launch(x, broken, qtype, got)
    bound = dot_tolerance(x, dequantize(raw, qtype))
    assert not within(got, want, bound)
    assert within(got[:, :-1], want[:, :-1], bound[:, :-1])  # every other column is still right


# ---- the elementwise and row ops -----------------------------------------------------------

def test_rmsnorm_matches_ref_and_numpy_backend():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((N_ROWS, D)) * 3).astype(np.float32)
    x[0] = 0  # an all-zero row: eps keeps it finite
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    want, got = np.zeros_like(x), np.zeros_like(x)
    rmsnorm_ref(x, w, 1e-5, want)
    rmsnorm(x, w, 1e-5, got)
    assert want.tobytes() == NumpyBackend().rmsnorm(x, w, 1e-5).tobytes()
    assert_within(got, want, rmsnorm_tolerance(want))


def test_rope_qkv_matches_numpy_backend_bit_for_bit():
    rng = np.random.default_rng(2)
    n_heads, n_kv, hd = (9, 3, 64) if ON_GPU else (3, 1, 8)
    qkv = rng.standard_normal((N_ROWS, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    angles = rng.uniform(0, 100, (N_ROWS, hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    want = [np.zeros((N_ROWS, h, hd), np.float32) for h in (n_heads, n_kv, n_kv)]
    got = [np.zeros_like(a) for a in want]
    rope_qkv_ref(qkv, cos, sin, *want)
    rope_qkv(qkv, cos, sin, *got)
    backend = NumpyBackend().rope_qkv(qkv, cos, sin, n_heads, n_kv, hd)
    for g, r, b in zip(got, want, backend):
        assert r.tobytes() == np.ascontiguousarray(b).tobytes()
        assert g.tobytes() == r.tobytes()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the simulator's exp is Python's, in float64
def test_swiglu_matches_ref():
    rng = np.random.default_rng(3)
    ff = 1536 if ON_GPU else 50
    gate_up = (rng.standard_normal((N_ROWS, 2 * ff)) * 4).astype(np.float32)
    gate_up[0, :3] = [-100.0, 0.0, 100.0]  # exp overflows, silu(0) = 0, silu(g) = g
    want, got = np.zeros((N_ROWS, ff), np.float32), np.zeros((N_ROWS, ff), np.float32)
    with np.errstate(over="ignore"):
        swiglu_ref(gate_up, want)
        assert want.tobytes() == NumpyBackend().swiglu(gate_up).tobytes()
    swiglu(gate_up, got)
    assert_within(got, want, SWIGLU_RTOL * np.abs(want) + SWIGLU_ATOL)


def test_residual_add_bit_for_bit():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((N_ROWS, D)).astype(np.float32)
    y = rng.standard_normal((N_ROWS, D)).astype(np.float32)
    want, got = x.copy(), x.copy()
    residual_ref(want, y)
    residual(got, y)
    assert got.tobytes() == want.tobytes() == (x + y).tobytes()


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_0", "Q4_1", "F16"])
def test_embed_bit_for_bit(qtype):
    rng = np.random.default_rng(5)
    rows, d = ((49152, 576) if qtype else (8192, 32)) if ON_GPU else ((50, 96) if qtype else (40, 32))
    table = quantized(rng, qtype, (rows, d), scale=0.5) if qtype else rng.standard_normal((rows, d)).astype(np.float32)
    ids = rng.integers(0, rows, N_ROWS + 2).astype(np.int32)
    ids[:2] = [rows - 1, ids[-1]]  # the last row; a repeated id
    want, got = np.zeros((len(ids), d), np.float32), np.full((len(ids), d), np.nan, np.float32)
    embed_ref(table, ids, want, qtype)
    embed(table, ids, got, qtype)
    assert got.tobytes() == want.tobytes()
    dense = table if qtype is None else dequantize(table, qtype)
    assert want.tobytes() == NumpyBackend().embed(dense, ids).tobytes()


def test_argmax_first_index_on_ties():
    """Ties within a thread's share, across threads and across chunks (thread blocks):
    the first index, as np.argmax."""
    rng = np.random.default_rng(6)
    vocab = 49152 if ON_GPU else 3 * ARGMAX_SPAN - 100  # three chunks under the simulator, the last partial
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    logits[0, [270, 17, 17 + ARGMAX_THREADS, ARGMAX_SPAN + 5]] = 50.0  # a four-way tie, two in one share
    logits[1, :] = -np.inf  # nothing finite: index 0, as np.argmax
    logits[2, vocab - 1] = 60.0  # the last index
    logits[3, [ARGMAX_THREADS + 1, 2]] = 70.0  # the later index in the earlier thread (1 before 2)
    logits[4, [2 * ARGMAX_SPAN + 3, ARGMAX_SPAN + 3]] = 80.0  # the same thread of two chunks: the earlier chunk
    want, got = np.zeros(5, np.int32), np.full(5, -1, np.int32)
    argmax_ref(logits, want)
    for _ in range(2):  # the second launch finds its tickets back at 0
        argmax(logits, got)
        assert list(want) == [17, 0, vocab - 1, 2, ARGMAX_SPAN + 3]
        assert got.tobytes() == want.tobytes()


def test_numpy_backend_matmul_is_the_ref():
    rng = np.random.default_rng(8)
    raw = quantized(rng, "Q4_1", (37, 96))
    x = rng.standard_normal((3, 96)).astype(np.float32)
    want = np.zeros((3, 37), np.float32)
    matvec_ref(x, raw, "Q4_1", want)
    assert want.tobytes() == NumpyBackend().matmul(x, dequantize(raw, "Q4_1")).tobytes()


# ---- the fast tier: fast/matvec_fused.py, matmul_tiled.py, embed.py, gguf_fetch.py ----------

def test_matvec_warps_split_a_row():
    """The fused kernel's warps share each row's parts and meet in shared memory (one warp
    under the simulator by default): 3 warps on 37 rows of 2 rows of x."""
    rng = np.random.default_rng(12)
    out, n_in = MATVEC_SHAPES[0]
    raw = quantized(rng, "Q4_1", (out, n_in))
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    want, got = np.zeros((2, out), np.float32), np.full((2, out), np.nan, np.float32)
    matvec_fused_ref(x, raw, "Q4_1", want)
    matvec_fused(x, raw, "Q4_1", got, warps=3)
    assert_within(got, want, dot_tolerance(x, dequantize(raw, "Q4_1")))


@pytest.mark.fast_twin
@pytest.mark.parametrize("n, kind", [(1, "normed"), (1, "gated"), (3, "add")])
def test_matvec_reads_the_next_matrix_ahead(n, kind):
    """`ahead`: every thread of the grid reads the first byte of its 32-byte sectors of the
    next matrix's rows; XORed over the grid that is every sector's (read_ahead_ref), each
    read once. And the product is the same bits as without: what is read ahead touches
    no sum."""
    rng = np.random.default_rng(21)
    out, n_in = MATVEC_SHAPES[0]
    raw = quantized(rng, "Q4_1", (out, n_in))
    x = rng.standard_normal((n, 2 * n_in if kind == "gated" else n_in)).astype(np.float32)
    kw = {"normed": dict(norm=np.ones(n_in, np.float32), eps=1e-5), "gated": dict(swiglu=True, add=True),
          "add": dict(add=True)}[kind]
    blocks, threads = matvec_grid(out, n_in)
    # rows of 20 bytes (Q4_1 of 32 values): more sectors than AHEAD - 1 passes of the grid's
    # threads, fewer than AHEAD; the last sector short
    n_sectors = blocks * threads * (AHEAD - 1) + 3
    nxt = rng.integers(0, 256, (-(-n_sectors * SECTOR // 20), 20), dtype=np.uint8)
    plain, ahead = np.ones((n, out), np.float32), np.ones((n, out), np.float32)
    matvec_fused(x, raw, "Q4_1", plain, **kw)
    read = np.zeros(blocks * threads, np.uint32)
    matvec_fused(x, raw, "Q4_1", ahead, **kw, ahead=cuda.to_device(nxt), ahead_out=read)
    assert ahead.tobytes() == plain.tobytes()
    assert np.bitwise_xor.reduce(read) == read_ahead_ref(nxt)


# (prologue, epilogue) pairs the forward pass launches: rmsnorm before q|k|v, gate|up and
# the head; swiglu before down with the residual add; the add after o.
FUSED = [("norm", False), ("swiglu", True), (None, True)]


@pytest.mark.fast_twin
@pytest.mark.parametrize("n", [1, 3] if ON_GPU else [2])
@pytest.mark.parametrize("prologue, add", FUSED)
def test_fused_matvec_matches_ref(prologue, add, n):
    """The fused kernel against the references composed: rmsnorm_ref or swiglu_ref, then
    the product, then the add; within dot_tolerance plus the prologue's own tolerance."""
    rng = np.random.default_rng(11)
    out, n_in = MATVEC_SHAPES[0]
    raw = quantized(rng, "Q4_1", (out, n_in))
    x = rng.standard_normal((n, 2 * n_in if prologue == "swiglu" else n_in)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32) if prologue == "norm" else None
    start = rng.standard_normal((n, out)).astype(np.float32) if add else np.full((n, out), np.nan, np.float32)
    want, got = start.copy(), start.copy()
    kwargs = dict(norm=norm, eps=1e-5, swiglu=prologue == "swiglu", add=add)
    matvec_fused_ref(x, raw, "Q4_1", want, **kwargs)
    matvec_fused(x, raw, "Q4_1", got, **kwargs)
    bound = fused_tolerance(x, dequantize(raw, "Q4_1"), norm, 1e-5, prologue == "swiglu")
    if add:  # the add rounds once more on each side
        bound = bound + 2 * 2.0 ** -24 * np.abs(want)
    assert_within(got, want, bound)
    if add:  # negative control: the same product stored, not added, leaves the bound
        stored = start.copy()
        matvec_fused(x, raw, "Q4_1", stored, norm=norm, eps=1e-5, swiglu=prologue == "swiglu")
        assert not within(stored, want, bound)


@pytest.mark.fast_twin
@pytest.mark.parametrize("n, warps", [(1, None), (2, 3)] if not ON_GPU else [(1, None), (3, None)])
def test_normed_matvec_scales_the_sum_by_one_over_rms(n, warps):
    """A normed kernel multiplies x * norm and scales each output's sum by 1 / rms, the
    squares summed from its first trip's loads (one warp, and three meeting in shared
    memory; every later trip of the block reuses them). x has an rms near 10, so a
    kernel that dropped the 1 / rms, or took it from another row, would be far outside the
    bound: the negative control is that product unscaled."""
    rng = np.random.default_rng(14)
    out, n_in = MATVEC_SHAPES[0]
    raw = quantized(rng, "Q4_1", (out, n_in))
    x = (10 * rng.standard_normal((n, n_in))).astype(np.float32)
    x[-1] *= 3  # rows with different norms
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    want, got = np.zeros((n, out), np.float32), np.full((n, out), np.nan, np.float32)
    matvec_fused_ref(x, raw, "Q4_1", want, norm=norm, eps=1e-5)
    matvec_fused(x, raw, "Q4_1", got, norm=norm, eps=1e-5, warps=warps)
    bound = fused_tolerance(x, dequantize(raw, "Q4_1"), norm, 1e-5)
    assert_within(got, want, bound)
    unscaled = np.full((n, out), np.nan, np.float32)
    matvec_fused(x * norm, raw, "Q4_1", unscaled, warps=warps)
    assert not within(unscaled, want, bound)


@pytest.mark.fast_twin
@pytest.mark.parametrize("n, warps", [(1, None), (1, 3), (2, 3)] if not ON_GPU else [(1, None), (3, None)])
def test_rope_epilogue_equals_matvec_then_rope_bit_for_bit(n, warps):
    """q|k|v with RoPE fused into the matvec's store: the same totals, rotated by
    rope_qkv_kernel's products in its order, so the bits of the unfused pair of launches
    (each held to its reference above). One warp and three (the shared-memory path); a
    negative control with the next position's angles must differ."""
    rng = np.random.default_rng(13)
    n_heads, n_kv, hd = (9, 3, 64) if ON_GPU else (3, 1, 8)
    n_in, n_out = (576 if ON_GPU else 96), (n_heads + 2 * n_kv) * hd
    raw = quantized(rng, "Q4_1", (n_out, n_in))
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    angles = rng.uniform(0, 100, (n + 1, hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    plain = np.full((n, n_out), np.nan, np.float32)
    matvec_fused(x, raw, "Q4_1", plain, norm=norm, eps=1e-5, warps=warps)
    want = [np.zeros((n, h, hd), np.float32) for h in (n_heads, n_kv, n_kv)]
    rope_qkv(plain, cos[:n], sin[:n], *want)
    want = np.concatenate([a.reshape(n, -1) for a in want], axis=1)
    fused, shifted = (np.full((n, n_out), np.nan, np.float32) for _ in range(2))
    matvec_fused(x, raw, "Q4_1", fused, norm=norm, eps=1e-5, rope=(cos[:n], sin[:n], n_heads, n_kv), warps=warps)
    assert fused.tobytes() == want.tobytes()
    matvec_fused(x, raw, "Q4_1", shifted, norm=norm, eps=1e-5, rope=(cos[1:], sin[1:], n_heads, n_kv), warps=warps)
    assert (shifted[:, :(n_heads + n_kv) * hd] != want[:, :(n_heads + n_kv) * hd]).any()
    assert shifted[:, (n_heads + n_kv) * hd:].tobytes() == want[:, (n_heads + n_kv) * hd:].tobytes()  # v unrotated
    ref = np.zeros((n, n_out), np.float32)
    matvec_fused_ref(x, raw, "Q4_1", ref, norm=norm, eps=1e-5, rope=(cos[:n], sin[:n], n_heads, n_kv))
    plain_ref = np.zeros((n, n_out), np.float32)
    matvec_fused_ref(x, raw, "Q4_1", plain_ref, norm=norm, eps=1e-5)
    want_ref = [np.zeros((n, h, hd), np.float32) for h in (n_heads, n_kv, n_kv)]
    rope_qkv_ref(plain_ref, cos[:n], sin[:n], *want_ref)
    assert ref.tobytes() == np.concatenate([a.reshape(n, -1) for a in want_ref], axis=1).tobytes()


# ---- the fast twins against their plain kernels ----------------------------------------------

@pytest.mark.fast_twin
@pytest.mark.parametrize("shape", MATVEC_SHAPES)
@pytest.mark.parametrize("qtype, n", MATVEC_CASES)
def test_fast_matvec_is_the_plain_matvec_within_dot_tolerance(qtype, n, shape):
    """fast/matvec_fused.py's `matvec` (the fused kernel, nothing fused) against the plain
    kernel on the same inputs. They add the same products in different orders (4 rows of W
    a block, a thread's parts of them, then the warp's tree), so not bit for bit: each is
    within (in + 1) u sum |x w| of the exact sums, so the two are within dot_tolerance of
    each other, and the fast one within it of the reference too."""
    check_fast_matvec(qtype, n, shape, np.random.default_rng(n + 40))


def check_fast_matvec(qtype, n, shape, rng):
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    want = np.zeros((n, shape[0]), np.float32)
    plain, fast = (np.full((n, shape[0]), np.nan, np.float32) for _ in range(2))
    matvec_ref(x, raw, qtype, want)
    matvec(x, raw, qtype, plain)
    fast_matvec.matvec(x, raw, qtype, fast)
    bound = dot_tolerance(x, dequantize(raw, qtype))
    assert_within(fast, plain, bound)
    assert_within(fast, want, bound)


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype, shape", [("Q5_0", (9, 96)), ("Q5_1", (9, 96)), ("Q4_K", (9, 512)),
                                          ("Q5_K", (9, 512)), ("Q6_K", (9, 512))] if not ON_GPU else
                         [(q, (1536, 1536)) for q in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")])
def test_the_fast_matvec_reads_q5_and_the_k_quants_as_the_plain_one(qtype, shape):
    """The fast tier takes these types through the plain parts whole (gguf_fetch.py's
    fetch_whole): within dot_tolerance of the plain kernel and of the reference."""
    check_fast_matvec(qtype, 1, shape, np.random.default_rng(41))


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype, n, shape", MATMUL_CASES + ([("Q4_K", 11, (29, 256)), ("Q6_K", 11, (29, 256))]
                                                            if not ON_GPU else [("Q4_K", 300, (1000, 1536))]))
def test_tiled_matmul_is_the_plain_matmul_bit_for_bit(qtype, n, shape):
    """fast/matmul_tiled.py's kernel makes the plain kernel's sums in the same order (every
    output's products added in order of k, the padded rows' zeros adding nothing): the same
    bits, on every case's cut tiles."""
    rng = np.random.default_rng(n + 60)
    raw = quantized(rng, qtype, shape)
    x = rng.standard_normal((n, shape[1])).astype(np.float32)
    plain, fast = (np.full((n, shape[0]), np.nan, np.float32) for _ in range(2))
    matmul(x, raw, qtype, plain)
    fast_matmul.matmul(x, raw, qtype, fast)
    assert fast.tobytes() == plain.tobytes()


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_0", "Q4_1", "F16"])
def test_dependent_embed_is_the_plain_embed_bit_for_bit(qtype):
    """fast/embed.py's kernels are the plain kernels' code after the wait: the same bytes."""
    rng = np.random.default_rng(9)
    rows, d = (50, 96) if qtype else (40, 32)
    table = quantized(rng, qtype, (rows, d), scale=0.5) if qtype else rng.standard_normal((rows, d)).astype(np.float32)
    ids = rng.integers(0, rows, N_ROWS + 2).astype(np.int32)
    plain, fast = (np.full((len(ids), d), np.nan, np.float32) for _ in range(2))
    embed(table, ids, plain, qtype)
    fast_embed.embed(table, ids, fast, qtype)
    assert fast.tobytes() == plain.tobytes()


def make_steps_kernel(part, fetch, decode):
    """A kernel that dequantizes every part of every row twice: with the plain dequantizer
    `part`, and with fast/gguf_fetch.py's two steps."""

    @cuda.jit
    def steps_kernel(a, b,
                     whole,  # (rows, in) float32, written: part's values, part q at 8 q
                     steps):  # (rows, in) float32, written: decode(fetch)'s
        row, q = cuda.blockIdx.x, cuda.threadIdx.x
        blk, p = q // PARTS, q % PARTS
        w = cuda.local.array(PART, float32)
        part(a, b, row, blk, p, w)
        for j in range(PART):
            whole[row, PART * q + j] = w[j]
        f = cuda.local.array((1, PART), float32)
        c = cuda.local.array((1, CODES), uint32)
        fetch(a, b, row, blk, p, f, c, 0)
        decode(f, c, 0, w)
        for j in range(PART):
            steps[row, PART * q + j] = w[j]

    return steps_kernel


@cuda.jit(device=True)
def decode_q8_0_unsigned(f, c, j, w):
    """decode_q8_0 with a bug: the int8 codes read as unsigned, their signs lost."""
    for h in range(4):
        w[2 * h] = float32(c[j, h] & 0xFF) * f[j, 0]
        w[2 * h + 1] = float32((c[j, h] >> 8) & 0xFF) * f[j, 0]


@pytest.mark.parametrize("qtype", QTYPES + ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_fetch_then_decode_is_the_plain_dequantizer_bit_for_bit(qtype):
    """The expert kernels' dequantizers in two steps (fast/gguf_fetch.py) give the plain
    dequantizer's bits for every part of every row. Negative control: a Q8_0 decode that
    loses the codes' signs is caught."""
    rng = np.random.default_rng(10)
    rows, n_in = 5, 256 if qtype in K_QUANT_F16 else 96
    raw = quantized(rng, qtype, (rows, n_in), scale=0.5)
    a, b = weight_views(raw, qtype)
    part = PARTS_OF[qtype][0]
    whole, steps = (np.full((rows, n_in), np.nan, np.float32) for _ in range(2))
    make_steps_kernel(part, *STEPS[qtype])[rows, n_in // PART](a, b, whole, steps)
    assert not np.isnan(whole).any()
    assert steps.tobytes() == whole.tobytes()
    if qtype == "Q8_0":
        make_steps_kernel(part, STEPS[qtype][0], decode_q8_0_unsigned)[rows, n_in // PART](a, b, whole, steps)
        assert steps.tobytes() != whole.tobytes()
