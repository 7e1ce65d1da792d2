"""The step's fast twins against their plain kernels, on the same inputs: fast/argmax.py
and fast/block_scores.py run the plain kernels' code launched as dependent, so they must
give the same bits (the simulator runs a dependent launch as a plain one; the sm_90 check
in tests/test_ptx_sm90.py holds the wait to its place)."""
import numpy as np

from strata_nb.fast import argmax as fast_argmax
from strata_nb.fast import block_scores as fast_scores
from strata_nb.fast.twins import fast_or_plain
from strata_nb.kernels.kv.quant_q4_0 import quantize_q4_0_ref
from strata_nb.kernels.step import argmax as plain_argmax
from strata_nb.kernels.step import block_scores as plain_scores


def test_the_twins_are_registered():
    assert fast_or_plain(plain_argmax.argmax) is fast_argmax.argmax
    assert fast_or_plain(plain_scores.block_scores) is fast_scores.block_scores
    assert fast_argmax.argmax.plain_twin is plain_argmax.argmax
    assert fast_scores.BLOCK_SCORES_KERNELS.keys() == plain_scores.BLOCK_SCORES_KERNELS.keys()


def test_fast_argmax_is_plain_argmax():
    """Three chunks of logits, the last partial, with ties across threads and chunks."""
    rng = np.random.default_rng(59)
    span, threads = plain_argmax.SPAN, plain_argmax.THREADS
    vocab = 3 * span - 77
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    logits[0, [300, 19, 19 + threads, span + 5]] = 40.0
    logits[1, :] = -np.inf
    logits[2, [2 * span + 1, span + 1]] = 41.0
    plain, fast = np.full(4, -1, np.int32), np.full(4, -2, np.int32)
    plain_argmax.argmax(logits, plain)
    fast_argmax.argmax(logits, fast)
    assert list(plain) == [19, 0, span + 1, int(np.argmax(logits[3]))]
    assert fast.tobytes() == plain.tobytes()


def test_fast_block_scores_are_plain_block_scores_bit_for_bit():
    """Two queries, 6 query heads on 2 KV heads, 11 blocks. Negative control: one
    block's sketch scale zeroed changes that block's scores, so the comparison sees a
    changed input."""
    rng = np.random.default_rng(60)
    n_q, n_heads, n_kv, hd, n_blocks, window = 2, 6, 2, 64, 11, 2
    positions = np.array([10 * 16 + 9, 4 * 16 + 15], np.int32)
    q = rng.standard_normal((n_q, n_heads, hd)).astype(np.float32)
    sketch = quantize_q4_0_ref(rng.standard_normal((n_blocks, n_kv, 16, hd)).astype(np.float32))
    plain = np.zeros((n_q, n_blocks), np.float32)
    fast = np.full_like(plain, 7.0)
    plain_scores.block_scores(q, sketch, positions, window, plain)
    fast_scores.block_scores(q, sketch, positions, window, fast)
    assert np.isfinite(plain[0, 1:9]).all() and np.isfinite(plain[1, 1:3]).all()  # the blocks each ranks
    assert fast.tobytes() == plain.tobytes()
    broken = sketch.copy()
    broken[6, :, :, 0:2] = 0  # block 6's first group scale: d = 0
    fast_scores.block_scores(q[:1], broken, positions[:1], window, fast[:1])
    assert fast[0, 6] != plain[0, 6] and np.delete(fast[0], 6).tobytes() == np.delete(plain[0], 6).tobytes()
