"""The decode step's attention of the fast tier (fast/attention_step.py: a split of the
selection per thread block, merged by the last to finish) against the plain kernel and
the reference, within attention.py's tolerance (the sums run in another order): every
format, one block per split, the tickets, splits that see nothing, the lone split, the
two builds."""
import numpy as np
import pytest
from numba import cuda

from attention_cases import (GARBAGE_READS, HEAD_DIM, N_BLOCKS, N_HEADS, N_KV, PAGE_TABLE, check_rotate_out,
                             filled_cache, mapped_copy, queries, run)
import strata_nb.fast.attention_step as attention_step_module
from strata_nb.fast.attention import attention
from strata_nb.gpu.launch import ticket_counters
from strata_nb.kernels.attention import attention as plain
from strata_nb.kernels.attention.attention import ATOL, RTOL, attention_ref
from strata_nb.kv_layout import BLOCK, FORMATS, shared_blocks_upto

pytestmark = GARBAGE_READS


def test_the_fast_launcher_is_the_plain_one_s_twin():
    from strata_nb.fast.twins import TWINS

    assert TWINS[plain.attention] is attention and attention.plain_twin is plain.attention


@pytest.mark.fast_twin
@pytest.mark.parametrize("fmt, n_queries", [(fmt, 3) for fmt in FORMATS] + [("fp16", 1), ("k8v4", 8)])
def test_kernel_matches_the_plain_kernel(fmt, n_queries):
    """Three queries at positions inside their blocks, in every format; a step (1) and a
    verify window (8)."""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, *queries(n_queries), PAGE_TABLE, pool, host)
    got, want = run(attention, *args), run(plain.attention, *args)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_rotate_out_in_the_merging_block():
    check_rotate_out(lambda *a, **k: attention(*a, tile=1, **k))


@pytest.mark.fast_twin
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_ref_one_block_per_split(fmt):
    """Every selected column its own split, padding columns too (a split that sees no
    cell): the last split to finish merges up to 4 partial softmaxes per head. (Three
    queries' merges, one block per split: the tickets test below.)"""
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    args = (fmt, *queries(1), PAGE_TABLE, pool, host)
    got = run(lambda *a: attention(*a, per_split=1), *args)
    np.testing.assert_allclose(got, run(attention_ref, *args), atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_step_kernel_leaves_its_tickets_at_zero():
    """The split that arrives last merges and resets its counter, so the next launch (or
    graph replay) starts from 0 and gives the same bits."""
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    args = ("int8", *queries(3), PAGE_TABLE, pool, host)
    first = run(lambda *a: attention(*a, per_split=1), *args)
    np.testing.assert_allclose(first, run(attention_ref, *args), atol=ATOL, rtol=RTOL)
    assert not ticket_counters("attention_step", (3, N_KV)).copy_to_host().any()
    np.testing.assert_array_equal(run(lambda *a: attention(*a, per_split=1), *args), first)


@pytest.fixture
def nan_records(monkeypatch):
    """The step kernel's records start as NaN, so a merge that read a record this launch
    did not write would give NaN (a graph replay finds the last token's records there)."""
    monkeypatch.setattr(attention_step_module, "device_empty",
                        lambda shape, dtype: cuda.to_device(np.full(shape, np.nan, dtype)))


@pytest.mark.fast_twin
@pytest.mark.parametrize("q_pos, blocks, active", [
    (5, [0, 1, 2, 3, 4, 5], 1),     # a replayed resident step near an empty context: one split sees a cell
    (37, [0, 1, 2, 3, 4, 5], 3),    # blocks 0..2 seen, 3..5 wholly after the query
    (90, [-1, 5, -1, 0, -1, 3], 3),  # a selection, padding between its blocks
    # a long list (more records than a warp's lanes load in one round of the merge), the
    # last block seen past the first 128
    pytest.param(90, [0 if j == 3 else 3 if j == 70 else 5 if j == 131 else -1 for j in range(140)], 3,
                 marks=pytest.mark.slow),  # 140 thread blocks: 11 s under the simulator
])
def test_splits_that_see_nothing_weigh_nothing(nan_records, q_pos, blocks, active):
    """One block per split, most of them past the query or padding: every split writes
    its record this launch (an empty one, m = -inf, where it sees no cell), so NaN
    scratch never reaches the merge, and the counters are back at 0."""
    assert sum(b >= 0 and b * BLOCK <= q_pos for b in blocks) == active
    pool, host = filled_cache("k8v4", PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(6).standard_normal((1, N_HEADS, HEAD_DIM), np.float32)
    args = ("k8v4", q, np.array([q_pos], np.int32), np.array([blocks], np.int32), PAGE_TABLE, pool, host)
    got = run(lambda *a: attention(*a, per_split=1, ordered=False), *args)  # no lone split: every record
    np.testing.assert_allclose(got, run(attention_ref, *args), atol=ATOL, rtol=RTOL)
    assert not ticket_counters("attention_step", (1, N_KV)).copy_to_host().any()


def test_a_query_that_sees_no_cell_gets_zeros(nan_records):
    """Every split empty (padding and blocks after the query): the output is 0, as the
    reference's."""
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(7).standard_normal((1, N_HEADS, HEAD_DIM), np.float32)
    args = ("int8", q, np.array([20], np.int32), np.array([[-1, 3, 4, -1]], np.int32), PAGE_TABLE, pool, host)
    np.testing.assert_array_equal(run(lambda *a: attention(*a, per_split=1), *args), 0)


@pytest.mark.fast_twin
def test_shared_selection_on_the_step_kernel():
    """A shared (1, S) selection sent to the one-query-per-block kernel (tile 1) is given a
    row per query first."""
    q_pos = np.array([40, 90], np.int32)
    pool, host = filled_cache("int8", PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(5).standard_normal((2, N_HEADS, HEAD_DIM), np.float32)
    args = ("int8", q, q_pos, shared_blocks_upto(q_pos), PAGE_TABLE, pool, host)
    np.testing.assert_allclose(run(lambda *a: attention(*a, tile=1), *args), run(attention_ref, *args),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_kernel_reads_device_pool_and_mapped_host():
    """The cuda backend's arrays: the pool in VRAM, the host copy in mapped pinned memory
    that the kernel reads in place."""
    pool, host = filled_cache("q4_0", PAGE_TABLE, n_slots=4)
    args = ("q4_0", *queries(1), PAGE_TABLE)
    want = run(plain.attention, *args, pool, host)
    got = run(attention, *args, {f: cuda.to_device(a) for f, a in pool.items()},
              {f: mapped_copy(a) for f, a in host.items()})
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_kernel_without_a_host_copy():
    """Every block resident and host=None, as the prompt's staging pool is read."""
    identity = np.arange(N_BLOCKS, dtype=np.int32)
    pool, _ = filled_cache("k8v4", identity, n_slots=N_BLOCKS)
    args = ("k8v4", *queries(1), identity, pool, None)
    np.testing.assert_allclose(run(attention, *args), run(plain.attention, *args), atol=ATOL, rtol=RTOL)


# ---- a lone split: the first split writes the output when no other sees a cell -----------

def lone_case(fmt, q_pos, seed=8):
    pool, host = filled_cache(fmt, PAGE_TABLE, n_slots=4)
    q = np.random.default_rng(seed).standard_normal((1, N_HEADS, HEAD_DIM), np.float32)
    return (fmt, q, np.array([q_pos], np.int32), np.array([np.arange(N_BLOCKS)], np.int32), PAGE_TABLE, pool, host)


@pytest.mark.fast_twin
@pytest.mark.parametrize("fmt, q_pos, per_split", [
    ("fp16", 5, 1), ("k8v4", 12, 1),   # the query's block alone in the first of six splits
    ("fp16", 40, 4), ("k8v4", 63, 4),  # three and four blocks in the first split of two
])
def test_a_lone_split_gives_the_merges_bits(nan_records, fmt, q_pos, per_split):
    """An ordered list whose cells all lie in its first split: that split writes the output
    itself (k8v4 rotated there too), with the same bits as the records and the merge give
    when the shortcut is off; the records are NaN, so the lone path reads none."""
    args = lone_case(fmt, q_pos)
    lone = run(lambda *a: attention(*a, per_split=per_split, rotate_out=fmt == "k8v4"), *args)
    merged = run(lambda *a: attention(*a, per_split=per_split, rotate_out=fmt == "k8v4", ordered=False), *args)
    assert lone.tobytes() == merged.tobytes()
    want = run(lambda *a: attention_ref(*a, rotate_out=fmt == "k8v4"), *args)
    np.testing.assert_allclose(lone, want, atol=ATOL, rtol=RTOL)
    assert not ticket_counters("attention_step", (1, N_KV)).copy_to_host().any()


# ---- two builds: two or three thread blocks an SM ------------------------------------------

def test_which_build_a_launch_gets(monkeypatch):
    """Two an SM while the thread blocks that can see a cell fit two to every SM; the
    default model's widest such list (3 KV heads of 64 dims, 4 blocks a split) on a
    132-SM GPU is 88 splits a KV head: 352 blocks, 5,632 cells."""
    monkeypatch.setattr(attention_step_module, "multiprocessors", lambda: 132)
    assert [attention_step_module.blocks_per_sm(n) for n in (1, 264, 265, 384)] == [2, 2, 3, 3]
    assert attention_step_module.two_per_sm_columns(3, 64) == 352
    assert attention_step_module.two_per_sm_columns(300, 64) == 0  # not one split per KV head


@pytest.mark.fast_twin
@pytest.mark.parametrize("fmt, q_pos, per_split", [("k8v4", 90, 1), ("fp16", 40, 4)])
def test_the_two_builds_give_the_same_bits(nan_records, monkeypatch, fmt, q_pos, per_split):
    """The builds for two and three thread blocks an SM differ in the registers a thread
    may use, not in arithmetic: the same bits through the merge (k8v4, rotated there) and
    through a lone split (fp16). The SM count is set so the same launch gets each build."""
    args = lone_case(fmt, q_pos)
    picks = []
    choose = attention_step_module.blocks_per_sm
    monkeypatch.setattr(attention_step_module, "blocks_per_sm", lambda n: picks.append(choose(n)) or picks[-1])
    out = []
    for sms in (1, 1000):
        monkeypatch.setattr(attention_step_module, "multiprocessors", lambda: sms)
        out.append(run(lambda *a: attention(*a, per_split=per_split, rotate_out=fmt == "k8v4"), *args))
    assert picks == [3, 2]
    assert out[0].tobytes() == out[1].tobytes()
    want = run(lambda *a: attention_ref(*a, rotate_out=fmt == "k8v4"), *args)
    np.testing.assert_allclose(out[0], want, atol=ATOL, rtol=RTOL)


@pytest.mark.fast_twin
def test_a_lone_split_trusts_the_order():
    """The shortcut is taken on the list's word: a device list that claims to be ordered
    but has a seen block after padding loses that block's cells (so the shortcut runs, and
    the order matters); a NumPy list is looked at, and a false claim is refused."""
    fmt, q, q_pos, _, page_table, pool, host = lone_case("int8", 40)
    blocks = np.array([[0, -1, 1, 2]], np.int32)  # blocks 0..2 seen, block 0 alone in split 0
    args = (fmt, q, q_pos, blocks, page_table, pool, host)
    want = run(attention_ref, *args)
    np.testing.assert_allclose(run(lambda *a: attention(*a, per_split=1), *args), want, atol=ATOL, rtol=RTOL)
    claimed = run(lambda *a: attention(*a[:3], cuda.to_device(blocks), *a[4:], per_split=1, ordered=True), *args)
    assert np.abs(claimed - want).max() > 100 * ATOL
    with pytest.raises(AssertionError, match="does not ascend"):
        run(lambda *a: attention(*a, per_split=1, ordered=True), *args)
