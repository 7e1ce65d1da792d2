"""The verify window's check (kernels/step/verify.py) against verify_ref, exactly: each
row's greedy pick and the number of drafts the model agrees with."""
import numpy as np
import pytest

from strata_nb.kernels.step.argmax import SPAN
from strata_nb.kernels.step.verify import verify, verify_ref


def window_logits(rng, T, vocab, agree):
    """T rows whose picks equal a draft list for the first `agree` rows, then differ."""
    logits = rng.standard_normal((T, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, T - 1).astype(np.int32)
    for i in range(T - 1):
        j = drafts[i] if i < agree else (drafts[i] + 1 + i) % vocab
        logits[i, j] = 9.0
    return logits, drafts


@pytest.mark.parametrize("T, agree", [(5, 0), (5, 2), (5, 4), (8, 7), (1, 0), (3, 1)])
def test_verify_equals_ref(T, agree):
    """None agreed, some, all of them, a full window of 8, a window of the token alone."""
    rng = np.random.default_rng(T * 10 + agree)
    vocab = SPAN + 37  # two chunks of the argmax, the last partial
    logits, drafts = window_logits(rng, T, vocab, agree)
    want_picks, want_kept = np.zeros(T, np.int32), np.zeros(1, np.int32)
    verify_ref(logits, drafts, want_picks, want_kept)
    picks, kept = np.full(T, -1, np.int32), np.full(1, -1, np.int32)
    verify(logits, drafts, picks, kept)
    assert picks.tobytes() == want_picks.tobytes() and kept.tobytes() == want_kept.tobytes()
    assert int(kept[0]) == agree
    assert list(picks) == list(np.argmax(logits, axis=1))


def test_verify_stops_at_the_first_disagreement():
    """Drafts 0 and 2 agree, draft 1 does not: one kept, not two. Negative control: a
    count of every agreeing draft (not the prefix) would say 2."""
    logits = np.zeros((4, 50), np.float32)
    logits[[0, 1, 2, 3], [7, 8, 9, 10]] = 1.0
    drafts = np.array([7, 3, 9], np.int32)
    picks, kept = np.zeros(4, np.int32), np.zeros(1, np.int32)
    verify(logits, drafts, picks, kept)
    assert list(picks) == [7, 8, 9, 10] and kept[0] == 1
    assert int((picks[:3] == drafts).sum()) == 2
