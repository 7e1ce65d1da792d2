"""The expert cache's policy (experts/policy.py) on hand-made usage counts."""
import numpy as np

from strata_nb.experts.policy import plan_moves


def test_candidates_fill_empty_slots_first_most_used_first():
    usage = np.array([0.0, 5.0, 2.0, 9.0, 1.9])
    res = np.full(5, -1, np.int32)
    assert plan_moves(usage, res, n_slots=2, most=10) == [(3, 0, -1), (1, 1, -1)]


def test_an_expert_below_the_candidate_bar_is_not_moved_in():
    usage = np.array([1.99, 0.0])
    assert plan_moves(usage, np.full(2, -1, np.int32), n_slots=2, most=10) == []


def test_a_swap_needs_the_margin_over_the_least_used_victim():
    usage = np.array([3.0, 1.0, 2.4, 2.6])  # experts 0, 1 resident in slots 1, 0
    res = np.array([1, 0, -1, -1], np.int32)
    # expert 3 (2.6) clears 1.0 + 1.5 and takes expert 1's slot 0; expert 2 (2.4) would
    # need 3.0 + 1.5 over the next victim
    assert plan_moves(usage, res, n_slots=2, most=10) == [(3, 0, 1)]


def test_at_most_the_allowed_swaps():
    usage = np.array([9.0, 8.0, 7.0, 0.1, 0.2, 0.3])  # experts 3, 4, 5 resident in slots 0, 1, 2
    res = np.array([-1, -1, -1, 0, 1, 2], np.int32)
    assert plan_moves(usage, res, n_slots=3, most=2) == [(0, 0, 3), (1, 1, 4)]


def test_empty_slots_fill_whatever_the_swaps_allowed():
    """Filling an empty slot evicts nothing: it is no swap, so --adapt-swaps does not cap
    it (a prompt chunk's adapt fills every slot it can at once)."""
    usage = np.array([9.0, 8.0, 7.0, 0.0])
    assert len(plan_moves(usage, np.full(4, -1, np.int32), n_slots=4, most=1)) == 3
    usage = np.array([9.0, 8.0, 7.0, 0.1])  # one slot empty, expert 3 resident in slot 0
    res = np.array([-1, -1, -1, 0], np.int32)
    assert plan_moves(usage, res, n_slots=2, most=1) == [(0, 1, -1), (1, 0, 3)]
