"""The page table, ring and CLOCK slot pool: counting, replacement and the inverse maps."""
import numpy as np

from strata_nb.kv.slots import SlotTable, StreamCounters


def blocks(*rows):
    width = max(map(len, rows))
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], np.int32)


def test_ring_maps_statically_and_refills_a_resumed_block():
    t = SlotTable(n_blocks=20, n_ring=4, n_pool=2)
    assert t.map_ring(0, 16 * 6 - 1) == []  # a prompt chunk over blocks 0..5: ring keeps 2..5
    assert [t.page_table[b] for b in range(6)] == [-1, -1, 2, 3, 0, 1]
    t.check_inverse()
    # a write resuming inside block 1 (left the ring) must refill it from the host copy
    assert t.map_ring(16 + 5, 16 + 5) == [(1, 1)]
    assert t.page_table[5] == -1 and t.page_table[1] == 1
    t.check_inverse()


def test_resolve_counts_and_clock():
    t = SlotTable(n_blocks=20, n_ring=2, n_pool=3)
    t.map_ring(16 * 10, 16 * 12 - 1)  # ring: blocks 10, 11
    c = StreamCounters()
    copies = t.resolve(blocks([0, 1, 10, 11], [0, 1, 11]), c)
    # query 0: 4 lookups, blocks 0 and 1 miss; query 1: 3 lookups, all hits now
    assert (c.lookups, c.misses, c.in_place) == (7, 2, 0)
    assert copies == [(0, 2), (1, 3)]
    t.check_inverse()
    # four misses, three pool slots, two of them used this step by hits: one copy, three in place
    copies = t.resolve(blocks([0, 1, 2, 3, 4, 5, 11]), c)
    assert c.misses == 2 + 4 and c.in_place == 3 and copies == [(2, 4)]
    t.check_inverse()
    # CLOCK: 0 and 1 were hit (referenced), 2 was just loaded (not referenced): 2 goes first
    copies = t.resolve(blocks([7]), c)
    assert copies == [(7, 4)] and t.page_table[2] == -1
    t.check_inverse()
    assert 0 < c.hit_rate < 1 and c.steps == 3


def test_reset_to_ring():
    t = SlotTable(n_blocks=20, n_ring=4, n_pool=2)
    t.map_ring(0, 16 * 9)
    t.resolve(blocks([0, 1]), StreamCounters())
    t.reset_to_ring(3)
    assert list(t.page_table[:4]) == [0, 1, 2, -1] and (t.page_table[4:] == -1).all()
    t.check_inverse()
