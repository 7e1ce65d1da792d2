"""The conversation cache's arena (serve/host_arena.py): ranges taken first fit, aligned,
given back and merged with their free neighbours, never overlapping; and the cache over
it under a random load: the budget holds, and no parked range is written over."""
import numpy as np

from strata_nb.serve.conversations import ConversationCache
from strata_nb.serve.host_arena import ALIGN, HostArena
from test_conversations import CELL_BYTES, RecordingKV


def test_ranges_are_taken_first_fit_and_merge_when_given_back():
    arena = HostArena(np.zeros(10 * ALIGN, np.uint8))
    a, b, c = arena.take(3 * ALIGN), arena.take(2 * ALIGN - 5), arena.take(4 * ALIGN)
    assert (a, b, c) == (0, 3 * ALIGN, 5 * ALIGN) and arena.used == 9 * ALIGN
    assert arena.view(b).nbytes == 2 * ALIGN  # rounded up to ALIGN
    assert arena.take(2 * ALIGN) is None  # one ALIGN is left
    arena.give(a)
    assert arena.take(2 * ALIGN) == 0  # the first free range that fits
    arena.give(b)  # frees [3, 5): beside the free [2, 3), merged
    assert arena.free == [[2 * ALIGN, 5 * ALIGN], [9 * ALIGN, 10 * ALIGN]]
    arena.give(0)
    arena.give(c)
    assert arena.free == [[0, 10 * ALIGN]] and arena.used == 0 and arena.take(10 * ALIGN) == 0


def test_a_random_load_keeps_the_budget_and_every_parked_range_intact():
    """300 requests over 12 conversations of varied lengths: each is resumed (restoring when
    the engine holds another), grown and parked. The stand-in KV fills a range with its
    length and checks it at every restore, so a range handed out twice shows."""
    rng = np.random.default_rng(0)
    kv = RecordingKV()
    c = ConversationCache(kv, 1, 300 * CELL_BYTES)
    convs = [[1000 * k + i for i in range(int(rng.integers(10, 120)))] for k in range(12)]
    for _ in range(300):
        k = int(rng.integers(len(convs)))
        c.resume(convs[k])
        convs[k] += [int(x) for x in rng.integers(1, 999, int(rng.integers(1, 20)))]
        c.park(convs[k])
        assert c.nbytes <= c.budget
        spans = sorted((p.start, p.start + p.nbytes) for p in c.parked.values())
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])), "overlapping ranges"
    assert kv.restored and c.evictions > 0
