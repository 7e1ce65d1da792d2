"""The conversation cache's bookkeeping, on a stand-in KV cache that records what it is
asked: which cells a prompt reuses (whole chunks, at least one token left to run), when a
restore is needed, the LRU by bytes, a conversation that grew replacing its shorter self,
one too large for the budget not parked, and a budget of 0 parking nothing."""
import numpy as np

from strata_nb.serve.conversations import ConversationCache, common_prefix

CHUNK = 4
CELL_BYTES = 256  # the stand-in's snapshot of n cells takes n * CELL_BYTES bytes (whole arena ranges)


class RecordingKV:
    def __init__(self):
        self.snapshots, self.restored = [], []

    def parking_memory(self, nbytes: int):
        return np.zeros(nbytes, np.uint8)

    def snapshot_nbytes(self, end: int) -> int:
        return end * CELL_BYTES

    def snapshot(self, end: int, into) -> dict:
        assert into.nbytes == end * CELL_BYTES
        into[:] = end % 251  # the cells' bytes, as far as the stand-in knows them
        self.snapshots.append(end)
        return {"end": end, "layers": [{"k": into}]}

    def restore(self, snap: dict):
        assert (snap["layers"][0]["k"] == snap["end"] % 251).all(), "a parked range written over"
        self.restored.append(snap["end"])


def cache(budget_cells: int) -> tuple[ConversationCache, RecordingKV]:
    kv = RecordingKV()
    return ConversationCache(kv, CHUNK, budget_cells * CELL_BYTES), kv


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix((1, 2), [1, 2, 3]) == 2


def test_a_prompt_reuses_the_whole_chunks_it_shares_and_runs_at_least_one_token():
    c, kv = cache(100)
    a = list(range(10))
    assert c.resume(a) == 0  # nothing parked yet
    c.park(a)
    assert kv.snapshots == [8] and list(c.parked) == [tuple(range(8))]  # 10 tokens: two whole chunks
    assert c.resume(a + [50, 51]) == 8 and kv.restored == []  # the engine still holds them: no copy
    c.park(a + [50, 51])  # 12 tokens: three chunks, the same conversation grown
    assert list(c.parked) == [tuple(range(10)) + (50, 51)]  # the shorter one is replaced
    assert c.resume(list(range(12))) == 8  # shares 10 tokens with it: two whole chunks
    assert c.resume(list(range(8))) == 4  # the same 8 tokens: one must be left to run, so one chunk


def test_where_rows_stand_alone_a_prompt_resumes_at_any_token():
    """chunk 1 (the cuda backend's rows-alone prompt path): the whole prompt is parked,
    and a later prompt reuses every token it shares but its last."""
    kv = RecordingKV()
    c = ConversationCache(kv, 1, 100 * CELL_BYTES)
    a = list(range(10))
    c.park(a)
    assert kv.snapshots == [10]
    assert c.resume(a + [50, 51]) == 10 and kv.restored == []
    assert c.resume(a[:7] + [99]) == 7
    assert c.resume(a) == 9  # one left to run


def test_a_conversation_the_engine_no_longer_holds_is_restored():
    c, kv = cache(100)
    a, b = list(range(9)), list(range(100, 109))
    c.park(a)
    c.resume(b)
    c.park(b)  # the engine's KV now holds b
    assert c.resume(a + [7]) == 8 and kv.restored == [8]
    assert c.stats()["restores"] == 1 and c.stats()["hits"] == 1


def test_the_skip_restore_fault_counts_the_cells_but_does_not_restore_them():
    kv = RecordingKV()
    c = ConversationCache(kv, CHUNK, 100 * CELL_BYTES, fault="skip-restore")
    c.park(list(range(9)))
    c.park(list(range(100, 109)))
    assert c.resume(list(range(10))) == 8 and kv.restored == []


def test_least_recently_used_leaves_first_and_the_budget_holds():
    c, _ = cache(20)  # room for 20 cells: two 8-cell conversations, not three
    convs = [list(range(k * 100, k * 100 + 9)) for k in range(3)]
    c.park(convs[0])
    c.park(convs[1])
    c.resume(convs[0] + [1])  # conversation 0 used again: 1 is now the least recent
    c.park(convs[2])
    assert [k[0] for k in c.parked] == [0, 200] and c.nbytes <= 20 * CELL_BYTES
    assert c.stats()["evictions"] == 1


def test_too_large_for_the_budget_is_not_parked_and_a_budget_of_0_parks_nothing():
    c, kv = cache(7)
    c.park(list(range(9)))  # 8 cells > 7
    assert not c.parked and c.resume(list(range(10))) == 0
    c, kv = cache(0)
    c.park(list(range(9)))
    assert not c.parked and kv.snapshots == []


def test_a_budget_the_host_cannot_reserve_is_a_clear_error():
    import pytest

    from strata_nb.errors import StrataError

    class Greedy(RecordingKV):
        def parking_memory(self, nbytes):
            raise MemoryError

    with pytest.raises(StrataError, match="lower --conversation-cache-mib"):
        ConversationCache(Greedy(), CHUNK, 2**50)
