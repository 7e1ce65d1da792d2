"""Attention over selected blocks: the kernel against the reference within the written
tolerance for every format; the reference against a plain loop; and the reference's
determinism (pool or host copy, the same bits)."""
import numpy as np
import pytest
from numba import config, cuda

from strata_nb.kernels.attention import ATOL, MAX_TILE_ROWS, RTOL, attention, attention_ref, tile_for
from strata_nb.kernels.attention_step import arrivals
from strata_nb.kernels.hadamard import hadamard_ref
from strata_nb.kernels.kv_append_fp16 import kv_append_fp16_ref
from strata_nb.kernels.kv_append_k8v4 import kv_append_k8v4_ref
from strata_nb.kernels.kv_append_q4 import kv_append_q4_ref
from strata_nb.kernels.kv_append_q8 import kv_append_q8_ref
from strata_nb.kernels.quant_int8 import dequantize_int8_ref
from strata_nb.kernels.quant_q4_0 import dequantize_q4_0_ref
from strata_nb.kv.formats import BLOCK, FORMATS, pool_arrays
from strata_nb.kv.select import all_blocks_upto, shared_blocks_upto

# The simulator runs every CUDA thread as a Python thread: 6 query heads on 3 KV heads
# there (still GQA), the default model's 9 on 3 on a GPU.
N_HEADS, N_KV = (6, 3) if config.ENABLE_CUDASIM else (9, 3)
HEAD_DIM = 64
N_BLOCKS = 6
PAGE_TABLE = np.array([2, -1, 0, 3, -1, 1], np.int32)  # blocks 1 and 4 are read from the host copy
WRITTEN = 91  # cells 0..90 are written; 91..95 of block 5 hold garbage no query may read

# n queries -> (q_pos, selected blocks with -1 padding). Every query's own block is
# selected and cut inside by its position; 83..90 is a verify window of 8.
QUERIES = {
    1: ([90], [[0, 5, -1, 4]]),
    3: ([37, 77, 90], [[2, -1, 0], [4, 1, -1], [5, 3, 1]]),
    8: (list(range(83, 91)), [[5, b, -1] for b in (0, 1, 3, 4, 0, 1, 3, 4)]),
}


def garbage(rng, n_rows, fmt):
    """Random bytes in every field: NaN and inf included, for unwritten cells to hide."""
    return {a.field: rng.integers(0, 256, (n_rows, N_KV, BLOCK, a.per_head * a.dtype.itemsize),
                                  dtype=np.uint8).view(a.dtype)
            for a in pool_arrays(fmt, HEAD_DIM)}


def append_ref(fmt, k, v, positions, page_table, pool, host):
    if fmt in ("fp32", "fp16"):
        kv_append_fp16_ref(k, v, positions, page_table, pool["k"], pool["v"], host["k"], host["v"])
    elif fmt == "int8":
        kv_append_q8_ref(k, v, positions, page_table, *(pool[f] for f in ("k_q", "k_s", "v_q", "v_s")),
                         *(host[f] for f in ("k_q", "k_s", "v_q", "v_s")))
    elif fmt == "q4_0":
        kv_append_q4_ref(k, v, positions, page_table, pool["k_q4"], pool["v_q4"], host["k_q4"], host["v_q4"])
    else:
        kv_append_k8v4_ref(k, v, positions, page_table, pool, host)


def filled_cache(fmt, page_table, n_slots, seed=0):
    """A pool and host copy of garbage, then cells 0..WRITTEN-1 through the one writer."""
    rng = np.random.default_rng(seed)
    pool, host = garbage(rng, n_slots, fmt), garbage(rng, N_BLOCKS, fmt)
    k = rng.standard_normal((WRITTEN, N_KV, HEAD_DIM), np.float32)
    v = rng.standard_normal((WRITTEN, N_KV, HEAD_DIM), np.float32)
    append_ref(fmt, k, v, np.arange(WRITTEN, dtype=np.int32), page_table, pool, host)
    return pool, host


def queries(n, seed=1):
    q_pos, blocks = QUERIES[n]
    q = np.random.default_rng(seed).standard_normal((n, N_HEADS, HEAD_DIM), np.float32)
    return q, np.array(q_pos, np.int32), np.array(blocks, np.int32)


def run(attend, fmt, q, q_pos, blocks, page_table, pool, host):
    out = np.full(q.shape, np.nan, np.float32)
    attend(fmt, q, q_pos, blocks, page_table, pool, host, out)
    return out


@pytest.mark.parametrize("n_queries", [1, 3, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_ref(fmt, n_queries):
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, *queries(n_queries), PAGE_TABLE, pool, host)
    want, got = run(attention_ref, *args), run(attention, *args)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n_queries", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_ref_one_block_per_split(fmt, n_queries):
    """Every selected column its own split, padding columns too (a split that sees no
    cell): the last split to finish merges up to 4 partial softmaxes per query and head."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, *queries(n_queries), PAGE_TABLE, pool, host)
    got = run(lambda *a: attention(*a, per_split=1), *args)
    np.testing.assert_allclose(got, run(attention_ref, *args), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tile", [1, 5])
def test_rotate_out_is_hadamard_of_the_output(tile):
    """rotate_out applies H where the output is written (the step kernel's merging block,
    or after the tiled kernel's combine): the same bits as hadamard_ref on the output,
    and the reference agrees within the tolerance."""
    q_pos = np.arange(WRITTEN - 5, WRITTEN, dtype=np.int32)
    blocks = all_blocks_upto(q_pos)
    q = np.random.default_rng(4).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    pool, host = filled_cache("k8v4", PAGE_TABLE, n_slots=4)
    args = ("k8v4", q, q_pos, blocks, PAGE_TABLE, pool, host)
    plain = run(lambda *a: attention(*a, tile=tile), *args)
    rotated = run(lambda *a: attention(*a, rotate_out=True, tile=tile), *args)
    np.testing.assert_array_equal(rotated, hadamard_ref(plain))
    want = run(lambda *a: attention_ref(*a, rotate_out=True), *args)
    np.testing.assert_allclose(rotated, want, atol=ATOL, rtol=RTOL)


def test_step_kernel_leaves_its_tickets_at_zero():
    """The split that arrives last merges and resets its counter, so the next launch (or
    graph replay) starts from 0 and gives the same bits."""
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    args = ("int8", *queries(3), PAGE_TABLE, pool, host)
    first = run(lambda *a: attention(*a, per_split=1), *args)
    assert not arrivals(3, N_KV).copy_to_host().any()
    np.testing.assert_array_equal(run(lambda *a: attention(*a, per_split=1), *args), first)


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
        np.testing.assert_array_equal(want, run(attention_ref, fmt, q, q_pos, all_blocks_upto(q_pos),
                                                PAGE_TABLE, pool, host))
        got = run(lambda *a: attention(*a, per_split=2, combine_groups=4, tile=5), *args)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_shared_selection_on_the_step_kernel():
    """A shared (1, S) selection sent to the one-query-per-block kernel (tile 1) is given a
    row per query first."""
    q_pos = np.array([40, 90], np.int32)
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(5).standard_normal((2, N_HEADS, HEAD_DIM), np.float32)
    args = ("int8", q, q_pos, shared_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    np.testing.assert_allclose(run(lambda *a: attention(*a, tile=1), *args), run(attention_ref, *args),
                               atol=ATOL, rtol=RTOL)


def test_queries_that_disagree_get_a_block_each():
    """Per-query selections (QSA, a verify window) that pick different blocks in one column
    cannot share a thread block: tile_for falls back to 1."""
    _, _, blocks = queries(3)
    assert tile_for(blocks, N_HEADS // N_KV, HEAD_DIM) == 1
    assert tile_for(all_blocks_upto(np.array([3, 40], np.int32)), N_HEADS // N_KV, HEAD_DIM) == 2


def test_kernel_without_a_host_copy():
    """Every block resident and host=None, as the prompt's staging pool is read."""
    identity = np.arange(N_BLOCKS, dtype=np.int32)
    pool, _ = filled_cache("k8v4", identity, n_slots=N_BLOCKS)
    args = ("k8v4", *queries(1), identity, pool, None)
    np.testing.assert_allclose(run(attention, *args), run(attention_ref, *args), atol=ATOL, rtol=RTOL)


def mapped_copy(a):
    m = cuda.mapped_array(a.shape, a.dtype)
    m[...] = a
    return m


def test_kernel_reads_device_pool_and_mapped_host():
    """The cuda backend's arrays: the pool in VRAM, the host copy in mapped pinned memory
    that the kernel reads in place."""
    pool, host = filled_cache("q4_0", PAGE_TABLE, n_slots=4)
    q, q_pos, blocks = queries(1)
    want = run(attention_ref, "q4_0", q, q_pos, blocks, PAGE_TABLE, pool, host)
    got = run(attention, "q4_0", q, q_pos, blocks, PAGE_TABLE,
              {f: cuda.to_device(a) for f, a in pool.items()}, {f: mapped_copy(a) for f, a in host.items()})
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


# ---- the reference: a plain loop, and determinism -------------------------------------------

def dequantized(fmt, host):
    """(cells, n_kv, D) float32 K and V of the whole host copy, in position order."""
    def side(s):
        kind = {"fp32": "float", "fp16": "float", "int8": "int8", "q4_0": "q4_0",
                "k8v4": "int8" if s == "k" else "q4_0"}[fmt]
        with np.errstate(invalid="ignore"):  # the garbage after WRITTEN, never used
            x = {"float": lambda: host[s].astype(np.float32),
                 "int8": lambda: dequantize_int8_ref(host[f"{s}_q"], host[f"{s}_s"]),
                 "q4_0": lambda: dequantize_q4_0_ref(host[f"{s}_q4"])}[kind]()
        return x.transpose(0, 2, 1, 3).reshape(-1, N_KV, HEAD_DIM)  # (block, cell) -> position
    return side("k"), side("v")


@pytest.mark.parametrize("fmt", FORMATS)
def test_ref_matches_a_plain_loop(fmt):
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    k, v = dequantized(fmt, host)
    q, q_pos, blocks = queries(3)
    got = run(attention_ref, fmt, q, q_pos, blocks, PAGE_TABLE, pool, host)
    for i in range(len(q)):
        cells = [p for b in blocks[i] if b >= 0 for p in range(b * BLOCK, (b + 1) * BLOCK) if p <= q_pos[i]]
        for h in range(N_HEADS):
            kv_h = h // (N_HEADS // N_KV)
            s = k[cells, kv_h].astype(np.float64) @ q[i, h] / np.sqrt(HEAD_DIM)
            p = np.exp(s - s.max())
            want = p @ v[cells, kv_h] / p.sum()
            np.testing.assert_allclose(got[i, h], want, atol=1e-5, rtol=1e-5)


def slots_from_host(host, page_table, n_slots):
    """A pool holding each resident block's bytes, copied from the host copy."""
    resident = np.flatnonzero(page_table >= 0)
    pool = {f: np.zeros((n_slots, *a.shape[1:]), a.dtype) for f, a in host.items()}
    for f in pool:
        pool[f][page_table[resident]] = host[f][resident]
    return pool


@pytest.mark.parametrize("fmt", FORMATS)
def test_ref_is_the_same_bits_from_pool_or_host(fmt):
    """All in place from the host copy, all from VRAM slots, or mixed: the same bytes in,
    the same bits out."""
    all_host, identity = np.full(N_BLOCKS, -1, np.int32), np.arange(N_BLOCKS, dtype=np.int32)
    _, host = filled_cache(fmt, all_host, n_slots=0)
    rng = np.random.default_rng(3)
    n_q = 40
    q = rng.standard_normal((n_q, N_HEADS, HEAD_DIM), np.float32)
    q_pos = rng.integers(0, WRITTEN, n_q).astype(np.int32)
    blocks = np.where(rng.random((n_q, N_BLOCKS)) < 0.7, np.arange(N_BLOCKS), -1).astype(np.int32)
    blocks[np.arange(n_q), q_pos // BLOCK] = q_pos // BLOCK  # a query always sees its own cell
    outs = [run(attention_ref, fmt, q, q_pos, blocks, table, slots_from_host(host, table, n_slots), host)
            for table, n_slots in ((all_host, 0), (identity, N_BLOCKS), (PAGE_TABLE, 4))]
    assert np.isfinite(outs[0]).all()
    for out in outs[1:]:
        assert out.tobytes() == outs[0].tobytes()
