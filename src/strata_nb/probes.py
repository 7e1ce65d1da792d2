"""Probes: checks of a run's health that token parity cannot make.

The missing-mirror bug class (Strata #1188: one writer path skips the host copy) passes
the checks a developer reaches for first. Needle retrieval still works, because the
prompt was written by a path that keeps the mirror; the first tokens still match, because
the lost cells are read back only after they leave VRAM. What shows every time is the
cache itself: a block in a VRAM slot whose host copy differs. The text shows it some of
the time: free generation, a few hundred tokens on, can fall into a loop.

- `repetition_score`: how much of a run of tokens repeats itself, the share of its
  n-grams already seen earlier in it; `loop_score`, the share seen within the last few
  tokens, a loop. The bench flags a row whose free run's loop score is above
  `DEGENERATE` (bench/report.py); the verify-window lab measures both with and without
  the fault (docs/labs/verify-window.md).
- `mirror_mismatches`: the blocks of a streamed cache whose VRAM slot and host copy
  disagree, the direct evidence (the parity tests assert it is 0).
"""
from __future__ import annotations

import numpy as np

from .kv_layout import BLOCK

NGRAM = 4
LOOP = 16  # tokens: a 4-gram seen again at most this far back is going round in a loop
# A free run whose loop score is above this is flagged degenerate: half its 4-grams repeat
# one from the last LOOP tokens. Greedy text from the small default model repeats whole
# sentences with nothing wrong (the whole-run score is high, and grows the longer it
# runs), but at sentence range; a run that has collapsed repeats a phrase of a few
# tokens over and over (docs/measured/verify_fault.md has both).
DEGENERATE = 0.5


# --8<-- [start:repetition_score]
def repetition_score(tokens, n: int = NGRAM, within: int | None = None) -> float:
    """The share of the n-grams of `tokens` that occurred earlier in it (with `within`:
    at most that many tokens earlier). 0 for text that never repeats, near 1 for a loop;
    0 for fewer than n + 1 tokens."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if len(grams) < 2:
        return 0.0
    last, repeats = {}, 0
    for i, g in enumerate(grams):
        repeats += g in last and (within is None or i - last[g] <= within)
        last[g] = i
    return repeats / len(grams)


def loop_score(tokens) -> float:
    """The share of 4-grams that repeat one from the last LOOP tokens: what the bench flags."""
    return repetition_score(tokens, NGRAM, LOOP)
# --8<-- [end:repetition_score]


# --8<-- [start:mirror_mismatches]
def mirror_mismatches(kv, end: int) -> int:
    """Blocks of cells [0, end), in any layer, held in a VRAM slot whose cells differ from
    the host copy's, bit for bit. 0 for a fully resident cache (it has no host copy)."""
    if not kv.streamed:
        return 0
    bad = 0
    kv.sync_from_device()
    for L in kv.layers:
        pool, host = ({f: kv.be.to_numpy(a) for f, a in arrays.items()} for arrays in (L.pool, L.host))
        for b in range(-(-end // BLOCK)):
            slot, n = int(L.slots.page_table[b]), min(BLOCK, end - b * BLOCK)
            if slot >= 0:
                bad += any(not np.array_equal(pool[f][slot][:, :n], host[f][b][:, :n]) for f in pool)
    return bad
# --8<-- [end:mirror_mismatches]
