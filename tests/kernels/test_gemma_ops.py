"""Gemma 3's three plain-tier ops against their references: GeGLU within geglu_tolerance,
the per-head RMS norm (QK-norm) within rmsnorm_tolerance at d = hd with its v heads copied
bit for bit, the scale bit for bit. Each reference against an independent form: GeGLU's
against the tanh form in float64, the head norm's against rmsnorm_ref head by head. Then
each backend's three new ops once.

Small, irregular shapes under the simulator (3 rows, ff 40, heads 2 + 1 + 1 of 64); a
Gemma 3 1B layer's with STRATA_NB_GPU=1 (ff 6912, heads 4 + 1 + 1 of 256). Same test bodies.
"""
import math

import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.backend import get_backend
from strata_nb.kernels.dense.geglu import geglu, geglu_ref, geglu_tolerance
from strata_nb.kernels.dense.residual import scale, scale_ref
from strata_nb.kernels.dense.rmsnorm import head_rmsnorm, head_rmsnorm_ref, rmsnorm_ref, rmsnorm_tolerance

N_ROWS = 67 if ON_GPU else 3
FF = 6912 if ON_GPU else 40
N_HEADS, N_KV, HD = (4, 1, 256) if ON_GPU else (2, 1, 64)
EPS = 1e-6  # Gemma 3's
# gate values across GELU's whole range: tanh(z) rounds to -1 below about -5.5 (the
# output to 0), g + 0.044715 g^3 overflows float32 beyond about 1.6e13 (tanh(inf) = 1)
EXTREMES = [-1e20, -1e4, -100.0, -10.0, -5.5, -5.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 5.0, 10.0, 100.0, 1e4, 1e20]


def within(got, want, bound) -> bool:
    return bool((np.abs(got.astype(np.float64) - want) <= bound).all())


def assert_within(got, want, bound):
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"off by up to {err.max():.3g}, {(err / bound).max():.3g} x the tolerance"


def gate_up_rows(seed: int) -> np.ndarray:
    """(N_ROWS, 2 FF) float32 gate|up rows; row 0's first gates are EXTREMES."""
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((N_ROWS, 2 * FF)) * 4).astype(np.float32)
    gate_up[0, :len(EXTREMES)] = EXTREMES
    return gate_up


def gelu_tanh_64(gate_up) -> np.ndarray:
    """gelu_tanh(gate) * up in float64 with exact constants: the formula, not the reference."""
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u


def qkv_rows(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fused q|k|v product's rows, heads of different scales, one q head all zero; and
    q_norm, k_norm unlike each other."""
    rng = np.random.default_rng(seed)
    heads = N_HEADS + 2 * N_KV
    qkv = rng.standard_normal((N_ROWS, heads, HD)) * rng.uniform(0.1, 30, (N_ROWS, heads, 1))
    qkv[1, 0] = 0  # eps keeps it finite
    q_norm, k_norm = (1 + 0.3 * rng.standard_normal((2, HD))).astype(np.float32)
    return qkv.reshape(N_ROWS, heads * HD).astype(np.float32), q_norm, k_norm


# ---- GeGLU -----------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered")  # g^3 of the gates near 1e20, as intended
def test_geglu_ref_is_the_tanh_form():
    """The float32 reference within the kernel's tolerance of the formula in float64 (a
    one-sided bound is about half of it: geglu.py), across EXTREMES too; and the erf form
    of GELU, the other one models use, is outside it (the negative control)."""
    gate_up = gate_up_rows(1)
    want = np.full((N_ROWS, FF), np.nan, np.float32)
    geglu_ref(gate_up, want)
    exact = gelu_tanh_64(gate_up)
    assert_within(want, exact, geglu_tolerance(gate_up, exact))
    assert (want[0, :5] == 0).all()  # tanh(z) rounds to -1 for the gates from -1e20 to -5.5
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    erf = 0.5 * g * (1.0 + np.frompyfunc(math.erf, 1, 1)(g / math.sqrt(2.0)).astype(np.float64)) * u
    assert not within(want, erf, geglu_tolerance(gate_up, exact))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the simulator's g^3 is a NumPy float32 scalar's
def test_geglu_matches_ref():
    gate_up = gate_up_rows(2)
    want, got = np.full((N_ROWS, FF), np.nan, np.float32), np.full((N_ROWS, FF), np.nan, np.float32)
    with np.errstate(over="ignore"):
        geglu_ref(gate_up, want)
    geglu(gate_up, got)
    assert_within(got, want, geglu_tolerance(gate_up, want))
    g, u = gate_up[0, :len(EXTREMES)], gate_up[0, FF:FF + len(EXTREMES)]
    big = g >= 1e4  # tanh(z) = 1: 0.5 g (1 + 1) u is g u, one rounding, on both sides
    assert (got[0, :len(EXTREMES)][big] == (g * u)[big]).all()


# ---- per-head RMS norm ------------------------------------------------------------------------

def test_head_rmsnorm_ref_is_rmsnorm_ref_head_by_head():
    """Each q head is rmsnorm_ref of that head's hd values with q_norm, each k head with
    k_norm, to the bit; each v head is the input's bytes."""
    qkv, q_norm, k_norm = qkv_rows(3)
    out = np.full_like(qkv, np.nan)
    head_rmsnorm_ref(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV, out)
    for h in range(N_HEADS + 2 * N_KV):
        cols = slice(h * HD, (h + 1) * HD)
        head = np.ascontiguousarray(qkv[:, cols])
        if h < N_HEADS + N_KV:
            want = np.empty_like(head)
            rmsnorm_ref(head, q_norm if h < N_HEADS else k_norm, EPS, want)
        else:
            want = head
        assert np.ascontiguousarray(out[:, cols]).tobytes() == want.tobytes(), f"head {h}"


def test_head_rmsnorm_matches_ref_and_copies_v():
    qkv, q_norm, k_norm = qkv_rows(4)
    want, got = np.full_like(qkv, np.nan), np.full_like(qkv, np.nan)
    head_rmsnorm_ref(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV, want)
    head_rmsnorm(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV, got)
    qk = (N_HEADS + N_KV) * HD  # the normed columns; the v heads follow
    heads = want[:, :qk].reshape(N_ROWS, -1, HD)
    assert_within(got[:, :qk], want[:, :qk], rmsnorm_tolerance(heads).reshape(N_ROWS, qk))
    assert got[:, qk:].tobytes() == qkv[:, qk:].tobytes()  # v untouched, to the bit
    assert (got[1, :HD] == 0).all()  # the all-zero head
    # negative control: the k heads normed with q_norm leave the bound
    swapped = np.full_like(qkv, np.nan)
    head_rmsnorm(qkv, q_norm, q_norm, EPS, N_HEADS, N_KV, swapped)
    k = slice(N_HEADS * HD, qk)
    assert not within(swapped[:, k], want[:, k], rmsnorm_tolerance(want[:, k].reshape(N_ROWS, -1, HD)).reshape(N_ROWS, -1))


# ---- the scale --------------------------------------------------------------------------------

def test_scale_bit_for_bit():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((N_ROWS, 1152 if ON_GPU else 100)) * 0.05).astype(np.float32)
    s = math.sqrt(x.shape[1])  # Gemma's embedding scale, rounded to float32 by both
    want, got = x.copy(), x.copy()
    scale_ref(want, s)
    scale(got, s)
    assert want.dtype == np.float32
    assert got.tobytes() == want.tobytes() == (x * np.float32(s)).tobytes()


# ---- the backends' ops -----------------------------------------------------------------------

def test_numpy_backend_gemma_ops_are_the_refs():
    be = get_backend("cpu")
    gate_up = gate_up_rows(6)[1:]  # no extremes: the reference's overflow warnings stay out
    want = np.empty((N_ROWS - 1, FF), np.float32)
    geglu_ref(gate_up, want)
    assert be.geglu(gate_up).tobytes() == want.tobytes()
    qkv, q_norm, k_norm = qkv_rows(7)
    want = np.empty_like(qkv)
    head_rmsnorm_ref(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV, want)
    assert be.head_rmsnorm(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV).tobytes() == want.tobytes()
    x = qkv.copy()
    assert be.scale_(x, 8.0) is x
    assert x.tobytes() == (qkv * np.float32(8.0)).tobytes()


def test_cuda_backend_gemma_ops_match_the_refs():
    be = get_backend("cuda", "plain")
    gate_up = gate_up_rows(8)[1:]
    want = np.empty((N_ROWS - 1, FF), np.float32)
    geglu_ref(gate_up, want)
    assert_within(be.to_numpy(be.geglu(be.asarray(gate_up))), want, geglu_tolerance(gate_up, want))
    qkv, q_norm, k_norm = qkv_rows(9)
    want = np.empty_like(qkv)
    head_rmsnorm_ref(qkv, q_norm, k_norm, EPS, N_HEADS, N_KV, want)
    got = be.to_numpy(be.head_rmsnorm(be.asarray(qkv), be.asarray(q_norm), be.asarray(k_norm), EPS, N_HEADS, N_KV))
    assert_within(got, want, rmsnorm_tolerance(want.reshape(N_ROWS, -1, HD)).reshape(N_ROWS, -1))
    x = be.asarray(qkv)
    assert be.scale_(x, 8.0) is x
    assert be.to_numpy(x).tobytes() == (qkv * np.float32(8.0)).tobytes()
