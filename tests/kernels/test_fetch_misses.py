"""fetch_misses: a prompt chunk's missed experts copied once into their transit slots, the
chunk's lookups of them pointed there; hits, and experts no token chose, left alone."""
import numpy as np

from strata_nb.fast.fetch_misses import fetch_misses, fetch_misses_ref

E, K, T, LAYERS = 5, 2, 11, 2
AT = E  # layer 1
N = 3  # slots of the cache; the transit slots are N .. N + E - 1


def case():
    rng = np.random.default_rng(4)
    host_gu = rng.integers(0, 2**32, (LAYERS * E, 48), dtype=np.uint32)
    host_down = rng.integers(0, 2**32, (LAYERS * E, 24), dtype=np.uint32)
    res = np.full(LAYERS * E, -1, np.int32)
    res[AT + 1], res[0] = 2, 0  # layer 1's expert 1 in slot 2 (a hit); layer 0's expert 0: another layer
    chosen = np.array([[1, 3], [3, 0], [0, 1], [3, 1]] * 3, np.int32)[:T]  # experts 2 and 4: nobody's
    slot_of = res[AT + chosen]  # route's lookups
    return host_gu, host_down, res, chosen, slot_of


def test_each_missed_expert_lands_once_in_its_transit_slot():
    host_gu, host_down, res, chosen, slot_of = case()
    outs = []
    for fn in (fetch_misses_ref, fetch_misses):
        slots_gu = np.zeros((N + E, host_gu.shape[1]), np.uint32)
        slots_down = np.zeros((N + E, host_down.shape[1]), np.uint32)
        looked_up = slot_of.copy()
        fn(chosen, looked_up, res, AT, host_gu, host_down, slots_gu, slots_down, N)
        outs.append((slots_gu, slots_down, looked_up))
    for want, got in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(got, want)
    slots_gu, slots_down, looked_up = outs[1]
    for e in (0, 3):  # the chunk's misses
        np.testing.assert_array_equal(slots_gu[N + e], host_gu[AT + e])
        np.testing.assert_array_equal(slots_down[N + e], host_down[AT + e])
    assert not slots_gu[N + 1].any() and not slots_gu[N + 2].any() and not slots_gu[N + 4].any()  # a hit, unchosen
    assert not slots_gu[:N].any()  # the cache's own slots are not written
    np.testing.assert_array_equal(looked_up, np.where(chosen == 1, 2, N + chosen))  # every lookup now a slot
