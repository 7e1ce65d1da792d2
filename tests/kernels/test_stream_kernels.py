"""The streaming kernels against their references: copy_runs and ring_restore byte for byte,
key_sketch byte for byte, block_scores within float32 summation order."""
import numpy as np
import pytest

from strata_nb.kernels.kv.key_sketch import key_sketch, key_sketch_ref, sketch_shape
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_ref, quantize_q4_0_ref
from strata_nb.kernels.step.block_scores import block_scores, block_scores_ref
from strata_nb.kernels.step.select_rows import candidates
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


def test_key_sketch_writes_each_cell_s_k_as_q4_0():
    rng = np.random.default_rng(2)
    before = rng.integers(0, 256, size=sketch_shape(6, N_KV, HD), dtype=np.uint8)
    for positions in ([14, 15, 16, 17, 18], [3], [16], [31, 32], list(range(5, 75)), [40, 7]):
        pos = np.array(positions, np.int32)
        k = rng.standard_normal((len(pos), N_KV, HD)).astype(np.float32)
        want, got = before.copy(), before.copy()
        key_sketch_ref(k, pos, want)
        key_sketch(k, pos, got)
        assert got.tobytes() == want.tobytes()
        for i, p in enumerate(pos):  # each written cell holds its K in q4_0, every other cell is untouched
            assert want[p // 16, :, p % 16].tobytes() == quantize_q4_0_ref(k[i]).tobytes()
        untouched = np.ones((6, 16), bool)
        untouched[pos // 16, pos % 16] = False
        assert (want.transpose(0, 2, 1, 3)[untouched] == before.transpose(0, 2, 1, 3)[untouched]).all()


def test_the_fast_key_sketch_writes_the_plain_bytes():
    """fast/kv_append.py's key_sketch: the plain kernel's code launched as dependent."""
    from strata_nb.fast.kv_append import key_sketch as fast_sketch

    rng = np.random.default_rng(3)
    before = rng.integers(0, 256, size=sketch_shape(6, N_KV, HD), dtype=np.uint8)
    pos = np.array([14, 15, 16, 17, 18, 40], np.int32)
    k = rng.standard_normal((len(pos), N_KV, HD)).astype(np.float32)
    want, got = before.copy(), before.copy()
    key_sketch(k, pos, want)
    fast_sketch(k, pos, got)
    assert got.tobytes() == want.tobytes() and got.tobytes() != before.tobytes()


def test_block_scores_of_gemma_s_heads():
    """head_dim 256, one KV head of 4 query heads (Gemma 3's): the kernel built for it agrees."""
    rng = np.random.default_rng(4)
    positions = np.array([9 * 16 + 5], np.int32)
    q = rng.standard_normal((1, 4, 256)).astype(np.float32)
    sketch = quantize_q4_0_ref(rng.standard_normal((10, 1, 16, 256)).astype(np.float32))
    want, got = np.zeros((1, 10), np.float32), np.zeros((1, 10), np.float32)
    block_scores_ref(q, sketch, positions, 2, want)
    block_scores(q, sketch, positions, 2, got)
    assert np.isfinite(want[0, 1:8]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_block_scores_are_each_block_s_best_cell():
    rng = np.random.default_rng(3)
    n_q, n_heads, n_blocks, window = 3, 9, 21, 2  # more blocks than a scoring thread block takes
    positions = np.array([20 * 16 + 3, 11 * 16, 3 * 16 + 15], np.int32)  # the last, a middle and an early block
    q = rng.standard_normal((n_q, n_heads, HD)).astype(np.float32)
    cells = rng.standard_normal((n_blocks, N_KV, 16, HD)).astype(np.float32)
    sketch = quantize_q4_0_ref(cells)
    want = np.zeros((n_q, n_blocks), np.float32)
    got = np.zeros_like(want)
    block_scores_ref(q, sketch, positions, window, want)
    block_scores(q, sketch, positions, window, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # the score is the largest q . k over the block's 4-bit keys and the query's heads, for
    # the blocks selection ranks: after block 0, before the window
    kv_of = np.arange(n_heads) // (n_heads // N_KV)
    dots = np.einsum("qhd,bhcd->qbhc", q, dequantize_q4_0_ref(sketch)[:, kv_of])
    for i, last in enumerate(positions // 16):
        ranked = np.arange(1, last - window + 1)
        assert list(candidates(int(positions[i]), window)) == list(ranked)
        np.testing.assert_allclose(want[i, ranked], dots[i, ranked].max(axis=(1, 2)), rtol=1e-5, atol=1e-4)
        others = np.setdiff1d(np.arange(n_blocks), ranked)
        assert (want[i, others] == -np.inf).all() and (got[i, others] == -np.inf).all()
    # one cell that matches query 0's head 4 makes its block query 0's best
    cells[13, 4 // 3, 7] = 3 * q[0, 4]
    block_scores_ref(q, quantize_q4_0_ref(cells), positions, window, want)
    assert int(np.argmax(want[0])) == 13
