"""Attention over selected blocks: the plain kernel against the reference within the
written tolerance, for every format and every pass (decode steps, a verify window, a
prompt chunk's queries sharing one row of blocks), reading the pool and the host copy in
place; the reference against a plain loop, and its determinism (pool or host copy, the
same bits). The fast tier's kernels: test_attention_step.py, test_attention_prompt.py."""
import numpy as np
import pytest
from numba import cuda

from attention_cases import (GARBAGE_READS, HEAD_DIM, N_BLOCKS, N_HEADS, N_KV, PAGE_TABLE, WRITTEN, check_rotate_out,
                             filled_cache, mapped_copy, queries, run)
from strata_nb.kernels.attention.attention import ATOL, RTOL, attention, attention_ref
from strata_nb.kernels.kv.quant_int8 import dequantize_int8_ref
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_ref
from strata_nb.kv_layout import BLOCK, FORMATS, all_blocks_upto, shared_blocks_upto

pytestmark = GARBAGE_READS


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_ref(fmt):
    """Three queries at positions inside their blocks (37, 77, 90), padding between the
    selected blocks, blocks read from the pool and from the host copy; the output rotated
    back where the format rotates V."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    rotate = fmt in ("q4_0", "k8v4")
    args = (fmt, *queries(3), PAGE_TABLE, pool, host)
    want = run(lambda *a: attention_ref(*a, rotate_out=rotate), *args)
    got = run(lambda *a: attention(*a, rotate_out=rotate), *args)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fmt, n_queries", [("int8", 1), ("fp16", 8), ("k8v4", 8)])
def test_a_step_and_a_verify_window(fmt, n_queries):
    """One query (a decode step) and eight at consecutive positions, each with its own
    selection (a verify window)."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, *queries(n_queries), PAGE_TABLE, pool, host)
    np.testing.assert_allclose(run(attention, *args), run(attention_ref, *args), atol=ATOL, rtol=RTOL)


def test_rotate_out_after_the_kernel():
    check_rotate_out(attention, np.array([17, 30], np.int32))  # early positions: two blocks to read


def test_a_prompt_chunk_s_queries_share_one_row_of_blocks():
    """A prompt chunk (13..18, across the edge of a resident block and one read from the
    host copy) reads one row of blocks that every query shares, each query up to its
    position. A query's bits do not depend on its chunk: queries 16..18 alone, as the last
    3 of the chunk, and with a row of 24 blocks in device memory (blocks no query reaches,
    as a chunk replayed from a graph reads) give the same bits."""
    fmt = "k8v4"  # int8 K, q4_0 V, rotated back
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q_pos = np.arange(13, 19, dtype=np.int32)
    q = np.random.default_rng(5).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    args = (fmt, q, q_pos, shared_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    chunk = run(lambda *a: attention(*a, rotate_out=True), *args)
    np.testing.assert_allclose(chunk, run(lambda *a: attention_ref(*a, rotate_out=True), *args), atol=ATOL, rtol=RTOL)
    last = run(lambda *a: attention(*a, rotate_out=True), fmt, q[3:], q_pos[3:], shared_blocks_upto(q_pos[3:]),
               PAGE_TABLE, pool, host)
    np.testing.assert_array_equal(chunk[3:], last)
    page_table = np.concatenate([PAGE_TABLE, np.full(18, -1, np.int32)])
    whole_row = cuda.to_device(np.arange(len(page_table), dtype=np.int32).reshape(1, -1))
    on_device = run(lambda f, q, p, b, *rest: attention(f, q, cuda.to_device(p), whole_row, *rest, rotate_out=True),
                    fmt, q[3:], q_pos[3:], None, page_table, pool, host)
    np.testing.assert_array_equal(on_device, last)


def test_a_query_that_sees_no_cell_gets_zeros():
    """Padding and blocks after the query only: the output is 0, as the reference's."""
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(7).standard_normal((1, N_HEADS, HEAD_DIM), np.float32)
    args = ("int8", q, np.array([20], np.int32), np.array([[-1, 3, 4, -1]], np.int32), PAGE_TABLE, pool, host)
    np.testing.assert_array_equal(run(attention, *args), 0)
    np.testing.assert_array_equal(run(attention_ref, *args), 0)


def test_kernel_without_a_host_copy():
    """Every block resident and host=None, as the prompt's staging pool is read."""
    identity = np.arange(N_BLOCKS, dtype=np.int32)
    pool, _ = filled_cache("k8v4", identity, n_slots=N_BLOCKS)
    args = ("k8v4", *queries(1), identity, pool, None)
    np.testing.assert_allclose(run(attention, *args), run(attention_ref, *args), atol=ATOL, rtol=RTOL)


def test_kernel_reads_device_pool_and_mapped_host():
    """The cuda backend's arrays: the pool in VRAM, the host copy in mapped pinned memory
    that the kernel reads in place (a streamed cache's blocks that are not resident)."""
    pool, host = filled_cache("q4_0", PAGE_TABLE, n_slots=4)
    q, q_pos, blocks = queries(3)
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


# ---- a sliding-window layer (Gemma 3's local layers) ---------------------------------------
WINDOW = 21  # not a multiple of a block: the window's first block is cut inside


@pytest.mark.parametrize("fmt", ["fp16", "k8v4"])
def test_a_window_cuts_the_cells_before_it(fmt):
    """window > 0: query i sees the cells in (q_pos[i] - window, q_pos[i]], as llama.cpp's
    sliding window (a key p0 is masked for query p1 where p1 - p0 >= window). The kernel
    agrees with the reference, each query's selection reaching past its window (cells
    the kernel must skip), and the reference with a plain loop over the window's cells."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q, q_pos, blocks = queries(8)
    blocks = all_blocks_upto(q_pos)  # every block from 0: most lie before the window
    rotate = fmt == "k8v4"
    args = (fmt, q, q_pos, blocks, PAGE_TABLE, pool, host)
    want = run(lambda *a: attention_ref(*a, rotate_out=rotate, window=WINDOW), *args)
    got = run(lambda *a: attention(*a, rotate_out=rotate, window=WINDOW), *args)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    everything = run(lambda *a: attention_ref(*a, rotate_out=rotate), *args)
    assert not np.allclose(everything, want, atol=1e-3)  # the window is not a no-op
    if fmt == "fp16":
        k, v = dequantized(fmt, host)
        for i in range(len(q)):
            cells = list(range(q_pos[i] - WINDOW + 1, q_pos[i] + 1))
            for h in range(N_HEADS):
                kv_h = h // (N_HEADS // N_KV)
                s = k[cells, kv_h].astype(np.float64) @ q[i, h] / np.sqrt(HEAD_DIM)
                p = np.exp(s - s.max())
                np.testing.assert_allclose(want[i, h], p @ v[cells, kv_h] / p.sum(), atol=1e-5, rtol=1e-5)


def test_a_window_in_a_prompt_chunk_s_shared_row():
    """A prompt chunk's queries share one row; each is cut at both ends of its window."""
    fmt = "int8"
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q_pos = np.arange(40, 52, dtype=np.int32)
    q = np.random.default_rng(6).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    args = (fmt, q, q_pos, shared_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    want = run(lambda *a: attention_ref(*a, window=WINDOW), *args)
    np.testing.assert_allclose(run(lambda *a: attention(*a, window=WINDOW), *args), want, atol=ATOL, rtol=RTOL)
