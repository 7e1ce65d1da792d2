"""The streaming kernels against their references: copy_runs and ring_restore byte for byte,
block_bounds exactly, block_scores within float32 summation order."""
import numpy as np
import pytest

from strata_nb.kernels.kv.block_bounds import block_bounds, block_bounds_ref
from strata_nb.kernels.step.block_scores import block_scores, block_scores_ref
from strata_nb.kernels.kv.copy_runs import as_words, copy_runs, copy_runs_ref
from strata_nb.kernels.kv.ring_restore import ring_restore, ring_restore_ref
from strata_nb.kv_layout import FORMATS, pool_arrays

N_KV, HD = 3, 64


def random_run(rng, n_blocks, spec):
    raw = rng.integers(0, 256, size=(n_blocks, N_KV, 16, spec.per_head * spec.dtype.itemsize), dtype=np.uint8)
    return raw.view(spec.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_runs_every_run_of_every_format(fmt):
    rng = np.random.default_rng(1)
    src_index = np.array([5, 0, 9, 3], np.int32)  # host blocks
    dst_index = np.array([2, 4, 0, 1], np.int32)  # pool slots
    for spec in pool_arrays(fmt, HD):
        host = random_run(rng, 11, spec)
        before = random_run(rng, 6, spec)
        want, got = before.copy(), before.copy()
        copy_runs_ref(as_words(host), as_words(want), src_index, dst_index)
        copy_runs(as_words(host), as_words(got), src_index, dst_index)
        assert got.tobytes() == want.tobytes()
        for s, d in zip(src_index, dst_index):
            assert want[d].tobytes() == host[s].tobytes()
        assert want[[3, 5]].tobytes() == before[[3, 5]].tobytes()  # other slots untouched


@pytest.mark.parametrize("end_block, n_ring", [(3, 4), (11, 4), (4, 4)])
def test_ring_restore(end_block, n_ring):
    rng = np.random.default_rng(end_block)
    spec = pool_arrays("k8v4", HD)[2]
    host, ring = random_run(rng, 12, spec), random_run(rng, n_ring + 2, spec)
    want, got = ring.copy(), ring.copy()
    ring_restore_ref(as_words(host), as_words(want), end_block, n_ring)
    ring_restore(as_words(host), as_words(got), end_block, n_ring)
    assert got.tobytes() == want.tobytes()
    for b in range(max(0, end_block - n_ring), end_block):
        assert want[b % n_ring].tobytes() == host[b].tobytes()
    assert want[n_ring:].tobytes() == ring[n_ring:].tobytes()  # pool slots untouched


def test_block_bounds_restart_and_widen():
    rng = np.random.default_rng(2)
    kmin0 = rng.standard_normal((6, N_KV, HD)).astype(np.float32)
    kmax0 = kmin0 + 1
    for positions in ([14, 15, 16, 17, 18], [3], [16], [31, 32], list(range(5, 75))):
        pos = np.array(positions, np.int32)
        k = rng.standard_normal((len(pos), N_KV, HD)).astype(np.float32)
        a_min, a_max, b_min, b_max = kmin0.copy(), kmax0.copy(), kmin0.copy(), kmax0.copy()
        block_bounds_ref(k, pos, a_min, a_max)
        block_bounds(k, pos, b_min, b_max)
        np.testing.assert_array_equal(a_min, b_min)
        np.testing.assert_array_equal(a_max, b_max)
    # a window that starts a block resets it: block 1 then holds exactly cells 16..18's range
    k = rng.standard_normal((3, N_KV, HD)).astype(np.float32)
    lo, hi = kmin0.copy(), kmax0.copy()
    block_bounds_ref(k, np.array([16, 17, 18], np.int32), lo, hi)
    np.testing.assert_array_equal(lo[1], k.min(0))
    np.testing.assert_array_equal(hi[1], k.max(0))


def test_block_scores_bound_every_cell():
    rng = np.random.default_rng(3)
    n_q, n_heads, n_blocks = 3, 9, 5
    q = rng.standard_normal((n_q, n_heads, HD)).astype(np.float32)
    cells = rng.standard_normal((n_blocks, N_KV, 16, HD)).astype(np.float32)
    kmin, kmax = cells.min(2), cells.max(2)
    want = np.zeros((n_q, n_blocks), np.float32)
    got = np.zeros_like(want)
    block_scores_ref(q, kmin, kmax, want)
    block_scores(q, kmin, kmax, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # the score is an upper bound on every q . k of the block, for every head
    kv_of = np.arange(n_heads) // (n_heads // N_KV)
    dots = np.einsum("qhd,bhcd->qbhc", q, cells[:, kv_of])
    assert (dots.max(axis=(2, 3)) <= want + 1e-4).all()
