"""QSA's block selection: the plain kernel (select_rows) against its reference, then the
two fast kernels that let a streamed or QSA decode step be replayed from a graph against
theirs: select_blocks (QSA's picks, or every block up to the query, with the lookup
counts) and map_ring (the ring follows the write). All byte for byte: they write indices."""
import numpy as np
import pytest

from strata_nb.fast.map_ring import map_ring, map_ring_ref
from strata_nb.fast.select_blocks import select_blocks, select_blocks_ref
from strata_nb.kernels.step.select_rows import budget_note, select_rows, select_width
from strata_nb.kernels.step.select_rows import select_rows_ref as host_select_blocks

N_BLOCKS = 13


def run_select_rows(scores, positions, window, budget, extra=0):
    """The plain kernel's rows and the reference's, both select_width (+ extra) wide."""
    width = select_width(scores.shape[1], window, budget) + extra
    got = np.full((len(positions), width), 99, np.int32)
    select_rows(scores, positions, window, budget, got)
    return got, host_select_blocks(scores, positions, window, budget, np.full_like(got, 99))


def test_select_rows_kernel_equals_ref():
    """Five queries over 37 blocks: at block 0, inside the first window, straddling a block
    edge, deep, and at the last cell; budgets that take candidates, one the window already
    fills, one below the window, one past every candidate, and 0."""
    rng = np.random.default_rng(59)
    n_blocks = 37
    scores = rng.standard_normal((5, n_blocks)).astype(np.float32)
    scores[:, [3, 9, 20, 21]] = 1.25  # ties: the lower block ranks first
    scores[2, 4], scores[2, 5] = -0.0, 0.0  # equal, as a sort compares them
    scores[3, [6, 7]] = -np.inf  # candidates whose score is -inf still rank, last
    positions = np.array([0, 40, 10 * 16 + 15, 23 * 16 + 1, n_blocks * 16 - 1], np.int32)
    for window, budget in [(2, 160), (3, 48), (4, 32), (1, 1000), (2, 0), (3, 17 * 16 + 5)]:
        got, want = run_select_rows(scores, positions, window, budget, extra=3)
        assert got.tobytes() == want.tobytes(), (window, budget, got, want)
        held = (want >= 0).sum(axis=1)
        assert held.max() <= select_width(n_blocks, window, budget)  # the width is enough ...
    assert held.max() == select_width(n_blocks, window, budget)  # ... and no more than a row can need


def test_select_rows_ranks_ties_by_block():
    """Candidates 1 .. 10, block 5 the best and the other nine tied, room for three: block 5,
    then blocks 1 and 2, as a stable sort picks. Negative control: ties given to the higher
    block would pick 10 and 9."""
    scores = np.zeros((1, 14), np.float32)
    scores[0, 5] = 1.0
    got, want = run_select_rows(scores, np.array([13 * 16 + 2], np.int32), 3, 7 * 16)
    assert list(got[0]) == list(want[0]) == [0, 1, 2, 5, 11, 12, 13]
    cand = np.arange(1, 11)
    higher_first = cand[np.lexsort((-cand, -scores[0, cand]))][:3]  # ties to the higher block
    assert sorted(higher_first) == [5, 9, 10] and not set(higher_first) <= set(got[0])


@pytest.mark.parametrize("n_q, n_blocks, window, budget", [(7, 29, 2, 11 * 16), (2, 70, 5, 33 * 16)])
def test_select_rows_kernel_equals_ref_on_random_rows(n_q, n_blocks, window, budget):
    """Random positions and scores, more candidates than a selection thread block has
    threads (32 under the simulator), and scores drawn from a few values: many ties."""
    rng = np.random.default_rng(n_blocks)
    scores = rng.integers(-3, 4, (n_q, n_blocks)).astype(np.float32) * np.float32(0.5)
    positions = rng.integers(0, n_blocks * 16, n_q).astype(np.int32)
    got, want = run_select_rows(scores, positions, window, budget)
    assert got.tobytes() == want.tobytes()


def test_select_rows_launcher_refuses_a_narrow_list():
    scores = np.zeros((1, 20), np.float32)
    with pytest.raises(AssertionError, match="a row can hold 8"):
        select_rows(scores, np.array([300], np.int32), 2, 128, np.zeros((1, 7), np.int32))


def run_select(impl, scores, pos, page_table, window, budget, width):
    chosen = np.full(scores.shape[1], 7, np.int32)
    out = np.full((1, width), 99, np.int32)
    counts = np.array([5, 1, 2], np.int64)  # added to, not overwritten
    impl(scores, np.array([pos], np.int32), page_table, window, budget, chosen, out, counts)
    return chosen, out, counts


# (position, window blocks, budget cells): candidates to rank, a window that reaches
# block 0, a budget the window already fills, dense
CASES = [(150, 2, 80), (200, 3, 64), (20, 4, 96), (150, 2, 32), (150, 2, 0), (7, 1, 48)]


@pytest.mark.parametrize("pos, window, budget", CASES)
def test_select_blocks_kernel_equals_ref(pos, window, budget):
    rng = np.random.default_rng(pos + budget)
    scores = rng.standard_normal((1, N_BLOCKS)).astype(np.float32)
    scores[0, [2, 5, 7]] = 1.5  # ties: the lower block ranks first, as a stable sort
    scores[0, 3] = -0.0
    scores[0, 4] = 0.0
    page_table = np.where(rng.random(N_BLOCKS) < 0.5, -1, rng.integers(0, 6, N_BLOCKS)).astype(np.int32)
    width = N_BLOCKS if budget == 0 else max(max(1, budget // 16), window + 1)
    want = run_select(select_blocks_ref, scores, pos, page_table, window, budget, width)
    got = run_select(select_blocks, scores, pos, page_table, window, budget, width)
    for w, g in zip(want, got):
        assert w.tobytes() == g.tobytes()
    sel = want[1][0][want[1][0] >= 0]
    if budget:  # the reference is the host path's own choice
        assert list(sel) == list(host_select_blocks(scores, np.array([pos]), window, budget)[0])
        plain = np.full((1, width), 99, np.int32)  # the plain twin: the same list
        select_rows(scores, np.array([pos], np.int32), window, budget, plain)
        assert plain.tobytes() == want[1].tobytes()
    assert want[2][0] == 5 + len(sel) and want[2][1] == 1 + (page_table[sel] < 0).sum() and want[2][2] == 3


@pytest.mark.parametrize("budget", [640, 0])
def test_select_blocks_kernel_many_blocks(budget):
    """More blocks than the last thread block has threads (32 under the simulator, 256 on a
    GPU), ranked by 38 thread blocks (8 blocks each under the simulator): the last to
    finish scans their flags into the list, each thread placing a run of blocks. Under the
    simulator, candidates past the thread blocks' shared copy of the scores (64) too."""
    n_blocks = 300
    rng = np.random.default_rng(budget)
    scores = rng.standard_normal((1, n_blocks)).astype(np.float32)
    scores[0, [3, 70, 71, 120, 250]] = 2.0  # ties ranked by different thread blocks
    page_table = np.where(rng.random(n_blocks) < 0.3, rng.integers(0, 9, n_blocks), -1).astype(np.int32)
    pos, window = 296 * 16 + 5, 3
    width = n_blocks if budget == 0 else budget // 16
    want = run_select(select_blocks_ref, scores, pos, page_table, window, budget, width)
    got = run_select(select_blocks, scores, pos, page_table, window, budget, width)
    for w, g in zip(want, got):
        assert w.tobytes() == g.tobytes()
    assert (want[1][0] >= 0).sum() == (297 if budget == 0 else 40)


def test_select_blocks_ranks_ties_by_block():
    """Five candidates with one score, room for two: blocks 1 and 2, as a stable sort picks."""
    scores = np.zeros((1, N_BLOCKS), np.float32)
    _, out, _ = run_select(select_blocks, scores, 6 * 16, np.full(N_BLOCKS, -1, np.int32), 1, 64, 4)
    assert list(out[0]) == [0, 1, 2, 6]


def test_select_blocks_ranks_nan_scores_last_as_the_host_does():
    """A NaN score (K holding NaN) sorts after every number in the host's stable sort of
    -scores, NaNs among themselves by block; the kernel must pick what the host picks."""
    scores = np.array([[0.1, np.nan, -np.inf, 0.5, np.nan, -2.0, 0.3, 0.0, 1.0, 0.2, 0.4, 0.6, 0.7]], np.float32)
    page_table = np.full(N_BLOCKS, -1, np.int32)
    pos, window = 10 * 16, 1
    for budget in (64, 112, 176):  # room for 2, 5 and 9 candidates: numbers, then the NaNs
        width = budget // 16
        want = run_select(select_blocks_ref, scores, pos, page_table, window, budget, width)
        got = run_select(select_blocks, scores, pos, page_table, window, budget, width)
        assert got[1].tobytes() == want[1].tobytes(), (budget, got[1], want[1])
    assert list(want[1][0]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # the budget of 11 takes both NaNs last


def tables(n_ring=2, n_pool=3):
    """Three layers' maps: each layer's ring and pool hold different blocks."""
    page_tables = np.full((3, N_BLOCKS), -1, np.int32)
    slot_blocks = np.full((3, n_ring + n_pool), -1, np.int32)
    for layer, held in enumerate([((4, 0), (5, 1), (1, 2), (8, 4)),  # ring: 4, 5; pool: 1, 8
                                  ((6, 0), (5, 1), (8, 2)),          # ring: 6, 5; pool: 8
                                  ()]):                              # nothing mapped
        for block, slot in held:
            page_tables[layer, block], slot_blocks[layer, slot] = slot, block
    return page_tables, slot_blocks


@pytest.mark.parametrize("pos", [5 * 16 + 3, 6 * 16, 8 * 16, 0])  # mapped already; ring moves on; a block in
def test_map_ring_kernel_equals_ref(pos):                          # the pool moves to the ring; block 0
    want, got = tables(), tables()
    map_ring_ref(np.array([pos], np.int32), *want, 2)
    map_ring(np.array([pos], np.int32), *got, 2)
    assert all(w.tobytes() == g.tobytes() for w, g in zip(want, got))
    block = pos // 16
    for page_table, slot_block in zip(*want):  # every layer's ring moved
        assert page_table[block] == block % 2 and slot_block[block % 2] == block
        for b in np.flatnonzero(page_table >= 0):  # still inverse maps
            assert slot_block[page_table[b]] == b


@pytest.mark.parametrize("budget", [7, 32, 272, 1000, 1024])
def test_the_budget_note_says_what_a_deep_query_reads(budget):
    """budget_note (printed at load) names the cells a query far into the context reads:
    the budget when it is whole blocks above the first block and the window, else the
    number the note gives."""
    import re

    window, pos = 16, 4000
    scores = np.random.default_rng(budget).standard_normal((1, pos // 16 + 1)).astype(np.float32)
    cells = 16 * int((host_select_blocks(scores, np.array([pos]), window, budget) >= 0).sum())
    note = budget_note(budget, window)
    assert cells == (budget if note is None else int(re.search(r"at most (\d+)", note).group(1)))
    assert (note is None) == (budget in (272, 1024))
