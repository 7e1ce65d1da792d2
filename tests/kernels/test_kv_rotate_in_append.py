"""Rotating inside the append: a q4 warp that rotates its head row itself (kv_append_q4's
`rotate`, fwht64_lanes) writes the bytes that rotating first with the hadamard kernel
writes, in the pool and in the host copy. This is what lets k8v4's append drop its
Hadamard launch without changing a byte of the cache."""
import numpy as np
import pytest

from strata_nb.kernels.kv.hadamard import hadamard_ref
from strata_nb.kernels.kv.kv_append_k8v4 import kv_append_k8v4_ref
from strata_nb.kernels.kv.kv_append_q4 import kv_append_q4, kv_append_q4_ref
from strata_nb.kv_layout import BLOCK, pool_arrays
from test_kv_hybrid_parity import append_windows, assert_parity

N_KV = 2
PAGE_TABLE = np.array([1, -1, 0], np.int32)  # block 1 is not resident


def q4_arrays(n_rows, head_dim):
    per_head = {a.field: a.per_head for a in pool_arrays("q4_0", head_dim)}
    return {f: np.zeros((n_rows, N_KV, BLOCK, n), np.uint8) for f, n in per_head.items()}


@pytest.mark.parametrize("head_dim", [64, 128])  # 128: two 64-value transforms a head row
def test_q4_warp_rotating_its_row_matches_rotating_first(head_dim):
    rng = np.random.default_rng(head_dim)
    n, first = 4, 14  # cells 14..17: block 0 (resident) into block 1 (not)
    k = rng.standard_normal((n, N_KV, head_dim), np.float32)
    v = rng.standard_normal((n, N_KV, head_dim), np.float32)
    k[1, 0, 5] = 40.0  # an outlier: the rotation spreads it over its 64 values
    positions = np.arange(first, first + n, dtype=np.int32)
    results = []
    for writer, kk, vv, rotate in ((kv_append_q4_ref, hadamard_ref(k), hadamard_ref(v), False),
                                   (kv_append_q4, k, v, True)):
        pool, host = q4_arrays(2, head_dim), q4_arrays(3, head_dim)
        writer(kk, vv, positions, PAGE_TABLE, pool["k_q4"], pool["v_q4"], host["k_q4"], host["v_q4"], rotate)
        results.append((pool, host))
    (pool_a, host_a), (pool_b, host_b) = results
    assert_parity(pool_a, host_a, pool_b, host_b)
    assert host_b["k_q4"][1, :, 1].any() and pool_b["v_q4"][1, :, 14].any()  # both blocks written


def test_q4_ref_rotates_when_asked():
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((2, 1, N_KV, 64), np.float32)
    positions = np.array([3], np.int32)
    out = []
    for kk, vv, rotate in ((k, v, True), (hadamard_ref(k), hadamard_ref(v), False), (k, v, False)):
        pool, host = q4_arrays(2, 64), q4_arrays(3, 64)
        kv_append_q4_ref(kk, vv, positions, PAGE_TABLE, pool["k_q4"], pool["v_q4"],
                         host["k_q4"], host["v_q4"], rotate)
        out.append(host["v_q4"].tobytes())
    assert out[0] == out[1] != out[2]


def test_k8v4_rotating_v_in_the_append_matches_rotating_first():
    """The engine's way (V rotated by the V half) against the old way (hadamard first, then
    the append told V is rotated): the same bytes, and not the bytes of an unrotated V.
    On the references; test_kv_hybrid_parity holds the kernel, which rotates in the
    append, to these same references byte for byte."""
    in_append = append_windows(kv_append_k8v4_ref)[:2]
    rotated_first = append_windows(
        lambda k, v, *args, **kw: kv_append_k8v4_ref(k, hadamard_ref(v), *args, v_rotated=True, **kw))[:2]
    assert_parity(*in_append, *rotated_first)
    unrotated = append_windows(kv_append_k8v4_ref, v_rotated=True)[:2]
    with pytest.raises(AssertionError, match="v_q4 differs"):
        assert_parity(*in_append, *unrotated)
