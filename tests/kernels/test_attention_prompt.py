"""The prompt kernel (a tile of queries per thread block, register tiles, a combine)
against the reference: a prompt chunk's selection as rows and as one shared row, the
output rotated back, and when queries may share a thread block (tile_for). The step
kernel and the reference are tested in test_attention.py."""
import numpy as np
import pytest
from numba import cuda

from attention_cases import HEAD_DIM, N_HEADS, N_KV, PAGE_TABLE, WRITTEN, check_rotate_out, filled_cache, queries, run
from strata_nb.kernels.attention.attention import ATOL, RTOL, attention, attention_ref
from strata_nb.kernels.attention import attention_prefill
from strata_nb.kernels.attention.attention_prefill import MAX_TILE_ROWS, tile_for
from strata_nb.kv_layout import all_blocks_upto, shared_blocks_upto


def test_rotate_out_after_the_combine():
    check_rotate_out(tile=5)


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


def test_queries_that_disagree_get_a_block_each():
    """Per-query selections (QSA, a verify window) that pick different blocks in one column
    cannot share a thread block: tile_for falls back to 1."""
    _, _, blocks = queries(3)
    assert tile_for(blocks, N_HEADS // N_KV, HEAD_DIM) == 1
    assert tile_for(all_blocks_upto(np.array([3, 40], np.int32)), N_HEADS // N_KV, HEAD_DIM) == 2



@pytest.mark.parametrize("q_pos", [np.arange(30, 35, dtype=np.int32), np.arange(86, 91, dtype=np.int32)],
                         ids=["early", "late"])
def test_splits_sized_on_the_device(q_pos, monkeypatch):
    """A prompt chunk replayed from a graph (engine/prompt_chunk.py) passes the whole
    cache's row of blocks, and its positions in device memory: the kernel sizes its splits
    from the last query's position. They must be the splits the host makes for the row
    cut at the chunk's last block, so the output has the same bits (one combine row here
    adds the splits in order, and a split with nothing to read adds exact zeros). Here a
    whole row of 24 blocks, splits of at least 4 blocks, and 2 splits a chunk: the late
    chunk reads 6 blocks, 4 + 2 (sized from the whole row, it would be one split of 12)."""
    monkeypatch.setattr(attention_prefill, "BLOCKS_PER_SPLIT", 4)
    monkeypatch.setattr(attention_prefill, "PROMPT_THREAD_BLOCKS", 2 * N_KV)  # one tile: 2 splits
    fmt = "k8v4"  # rotates the output back, after the combine
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    page_table = np.concatenate([PAGE_TABLE, np.full(18, -1, np.int32)])  # blocks no query reaches
    whole_row = cuda.to_device(np.arange(len(page_table), dtype=np.int32).reshape(1, -1))
    q = np.random.default_rng(5).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    on_device = run(lambda f, q, p, b, *rest: attention(f, q, cuda.to_device(p), whole_row, *rest,
                                                        splits_on_device=True), fmt, q, q_pos, None, page_table,
                    pool, host)
    cut = shared_blocks_upto(q_pos)
    on_host = run(attention, fmt, q, q_pos, cut, PAGE_TABLE, pool, host)
    np.testing.assert_array_equal(on_device, on_host)
    np.testing.assert_allclose(on_device, run(attention_ref, fmt, q, q_pos, cut, PAGE_TABLE, pool, host),
                               atol=ATOL, rtol=RTOL)
