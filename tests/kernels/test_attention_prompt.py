"""The fast tier's prompt kernel (fast/attention_prefill.py: a tile of queries per thread
block, register tiles, a combine) against the reference and the plain kernel: a prompt
chunk's selection as rows and as one shared row, the output rotated back, and when
queries may share a thread block (tile_for). The plain kernel and the reference are
tested in test_attention.py, the step kernel in test_attention_step.py."""
import numpy as np
import pytest
from numba import cuda

from attention_cases import (GARBAGE_READS, HEAD_DIM, N_HEADS, N_KV, PAGE_TABLE, WRITTEN, check_rotate_out,
                             filled_cache, queries, run)
from strata_nb.fast import attention_prefill
from strata_nb.fast.attention import attention
from strata_nb.fast.attention_prefill import MAX_TILE_ROWS, tile_for
from strata_nb.kernels.attention import attention as plain
from strata_nb.kernels.attention.attention import ATOL, RTOL, attention_ref
from strata_nb.kv_layout import all_blocks_upto, shared_blocks_upto

pytestmark = [GARBAGE_READS, pytest.mark.fast_twin]  # the fast tier's kernel: the full tier (conftest.py)


def test_rotate_out_after_the_combine():
    check_rotate_out(lambda *a, **k: attention(*a, tile=5, **k))


@pytest.mark.slow  # two formats over 13 queries: a minute under the simulator (the default tier's
# prompt-kernel check is test_rotate_out_after_the_combine)
def test_prompt_chunk_in_tiles():
    """A prompt chunk's selection, as each query's row (all_blocks_upto: its blocks so far,
    -1 after) and as one row every query shares (shared_blocks_upto, what the cache sends:
    the positions mask the rest): several queries share each thread block, the last tile
    partly filled, over several splits (one of them a part round) merged by several
    combine rows."""
    q_pos = np.arange(WRITTEN - 13, WRITTEN, dtype=np.int32)  # 78..90: blocks 4 and 5
    most = min(len(q_pos), MAX_TILE_ROWS // (N_HEADS // N_KV))  # as many as a tile holds
    assert tile_for(all_blocks_upto(q_pos), N_HEADS // N_KV, HEAD_DIM) == most
    assert tile_for(shared_blocks_upto(q_pos), N_HEADS // N_KV, HEAD_DIM, len(q_pos)) == most
    q = np.random.default_rng(3).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    for fmt, blocks in (("fp16", all_blocks_upto(q_pos)), ("k8v4", shared_blocks_upto(q_pos))):
        pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
        args = (fmt, q, q_pos, blocks, PAGE_TABLE, pool, host)
        want = run(attention_ref, *args)
        # the two forms of the selection: the same cells (the reference works per-query rows
        # out one query at a time and a shared row as one product, so within a rounding)
        np.testing.assert_allclose(want, run(attention_ref, fmt, q, q_pos, all_blocks_upto(q_pos), PAGE_TABLE, pool,
                                             host), rtol=1e-5, atol=1e-6)
        got = run(lambda *a: attention(*a, per_split=2, combine_groups=4, tile=5), *args)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(got, run(plain.attention, *args), atol=ATOL, rtol=RTOL)


def test_a_prompt_chunk_matches_the_plain_kernel():
    """Four queries across a block's edge share one row of blocks (the cache's form), in
    tiles of 2 over splits of one block: the plain kernel's outputs within the tolerance."""
    q_pos = np.arange(14, 18, dtype=np.int32)
    q = np.random.default_rng(9).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    args = ("int8", q, q_pos, shared_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    got = run(lambda *a: attention(*a, per_split=1, tile=2), *args)
    np.testing.assert_allclose(got, run(plain.attention, *args), atol=ATOL, rtol=RTOL)


def test_queries_that_disagree_get_a_block_each():
    """Per-query selections (QSA, a verify window) that pick different blocks in one column
    cannot share a thread block: tile_for falls back to 1."""
    _, _, blocks = queries(3)
    assert tile_for(blocks, N_HEADS // N_KV, HEAD_DIM) == 1
    assert tile_for(all_blocks_upto(np.array([3, 40], np.int32)), N_HEADS // N_KV, HEAD_DIM) == 2




def test_rows_alone_a_query_gets_its_bits_in_any_chunk(monkeypatch):
    """rows_alone: a query's output is the same whatever chunk it comes in and however far
    the row of blocks reaches (so a conversation cache can resume a prompt at any token,
    engine/prompt_chunk.py). Queries 86..90 alone, and as the last 5 of 78..90, and with
    a whole row of 24 blocks in device memory (a chunk replayed from a graph): the same
    bits. Splits of 4 blocks from block 0 (two here). The negative control: sized by the
    chunk (rows_alone off, tiles of 5 queries), the 13-query chunk makes one split where 5
    queries make two, and the bits differ."""
    monkeypatch.setattr(attention_prefill, "ALONE_BLOCKS_PER_SPLIT", 4)
    monkeypatch.setattr(attention_prefill, "BLOCKS_PER_SPLIT", 1)
    monkeypatch.setattr(attention_prefill, "PROMPT_THREAD_BLOCKS", 2 * N_KV)  # one tile: 2 splits; three: 1
    fmt = "k8v4"  # rotates the output back, after the combine
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q_pos = np.arange(78, 91, dtype=np.int32)
    q = np.random.default_rng(5).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    outputs = {}
    for alone in (True, False):
        # the control's tiles hold 5 queries, so the 13 make three tiles whatever kernel runs
        # (the tensor-core kernel's GPU tile would hold all 13: one tile, two splits, as the 5)
        tile = None if alone else 5
        chunk = run(lambda *a: attention(*a, rows_alone=alone, tile=tile), fmt, q, q_pos, shared_blocks_upto(q_pos),
                    PAGE_TABLE, pool, host)[8:]
        five = run(lambda *a: attention(*a, rows_alone=alone, tile=tile), fmt, q[8:], q_pos[8:],
                   shared_blocks_upto(q_pos[8:]), PAGE_TABLE, pool, host)
        outputs[alone] = chunk, five
    chunk, five = outputs[True]
    np.testing.assert_array_equal(chunk, five)
    page_table = np.concatenate([PAGE_TABLE, np.full(18, -1, np.int32)])  # blocks no query reaches
    whole_row = cuda.to_device(np.arange(len(page_table), dtype=np.int32).reshape(1, -1))
    on_device = run(lambda f, q, p, b, *rest: attention(f, q, cuda.to_device(p), whole_row, *rest, rows_alone=True),
                    fmt, q[8:], q_pos[8:], None, page_table, pool, host)
    np.testing.assert_array_equal(on_device, five)
    np.testing.assert_allclose(five, run(attention_ref, fmt, q[8:], q_pos[8:], shared_blocks_upto(q_pos[8:]),
                                         PAGE_TABLE, pool, host), atol=ATOL, rtol=RTOL)
    chunk, five = outputs[False]
    assert not np.array_equal(chunk, five)


def test_the_combine_skips_splits_that_saw_nothing():
    """A split that saw no cell (m = -inf, l = 0) writes no V sums, and the combine does not
    read them: NaN left in those sums must not reach the output, which must be the splits'
    own merge (numpy). Reading them, as a weight of 0 times the sums would, gives NaN."""
    from strata_nb.fast.attention_prefill import attention_combine_kernel

    rng = np.random.default_rng(11)
    n_q, n_heads, n_splits, d = 3, 2, 5, HEAD_DIM
    m = rng.standard_normal((n_q, n_heads, n_splits)).astype(np.float32)
    l = rng.uniform(0.5, 2.0, (n_q, n_heads, n_splits)).astype(np.float32)
    acc = rng.standard_normal((n_q, n_heads, n_splits, d)).astype(np.float32)
    empty = np.zeros((n_q, n_heads, n_splits), bool)
    empty[0, :, 2:] = True  # query 0 reaches two splits, query 1 all, query 2 only its last
    empty[2, :, :4] = True
    m[empty], l[empty], acc[empty] = -np.inf, 0.0, np.nan
    out = cuda.device_array((n_q, n_heads, d), np.float32)
    attention_combine_kernel[(n_q, n_heads), (d, 4)](cuda.to_device(m), cuda.to_device(l), cuda.to_device(acc), out)
    w = np.where(empty, 0.0, np.exp(m - np.where(empty, -np.inf, m).max(axis=2, keepdims=True)))
    want = (np.nan_to_num(acc) * w[..., None]).sum(axis=2) / (l * w).sum(axis=2)[..., None]
    got = out.copy_to_host()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
