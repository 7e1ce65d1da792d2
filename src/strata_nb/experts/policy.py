"""Which experts hold the VRAM slots: Strata's policy of decayed usage counts.

Every expert of every layer has a usage count: the lookups the router made of it (a token
choosing it) since the last adapt are added, and after each adapt the counts are
multiplied by DECAY, so an expert used long ago fades and one used now rises. At each
adapt (every `adapt_every` passes, and after every prompt chunk: experts/cache.py) the
policy moves experts:

- a candidate is an expert in no slot whose usage is at least CANDIDATE;
- candidates fill empty slots first, most used first, as many as there are;
- then each remaining candidate, most used first, takes the slot of the least used
  resident expert, but only if its usage is at least that victim's + MARGIN: a slot is
  not traded for a small difference, which would copy weights back and forth. At most
  `adapt_swaps` such swaps an adapt.
"""
from __future__ import annotations

import numpy as np

DECAY = 0.7  # usage is multiplied by this after each adapt
CANDIDATE = 2.0  # usage an expert in no slot needs to be moved in
MARGIN = 1.5  # usage a candidate needs over the resident expert it evicts


# --8<-- [start:plan_moves]
def plan_moves(usage,    # (L * E,) float64: decayed lookups of each expert
               res,      # (L * E,) int32: each expert's slot, or -1
               n_slots: int,
               most: int):  # swaps allowed this adapt (--adapt-swaps); filling an empty slot is no swap
    """-> [(expert, slot, evicted expert or -1)]: the copies to make, in order."""
    taken = res[res >= 0]
    empty = sorted(set(range(n_slots)) - set(taken.tolist()))
    outside = np.flatnonzero((res < 0) & (usage >= CANDIDATE))
    candidates = outside[np.argsort(-usage[outside], kind="stable")].tolist()  # most used first
    inside = np.flatnonzero(res >= 0)
    victims = inside[np.argsort(usage[inside], kind="stable")].tolist()  # least used first
    moves, swaps = [], 0
    for expert in candidates:
        if empty:
            moves.append((expert, empty.pop(0), -1))
        elif swaps == most:
            break
        elif victims and usage[expert] >= usage[victims[0]] + MARGIN:
            swaps += 1
            victim = victims.pop(0)
            moves.append((expert, int(res[victim]), victim))
        else:
            break  # candidates come most used first: no later one clears the margin either
    return moves
# --8<-- [end:plan_moves]
