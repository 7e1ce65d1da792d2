"""Prompt-lookup drafting: guess the next tokens by finding the last few tokens earlier in
the text (the prompt and the output so far) and copying what followed them there.

A reply that quotes, edits or summarizes its prompt repeats long runs of it; when the last
n tokens occurred before, the tokens after that occurrence are a cheap guess at what comes
next. The model then checks the guesses in one batched pass (engine.py, `verify`): each
one it agrees with is a token gained without a step of its own. Longer matches are tried
first (up to `max_ngram`), and among equal lengths the most recent occurrence.

The engine drafts only from a match of at least MIN_NGRAM tokens, and sizes each window
from how the last one went (WindowWidth). A single repeated token
(a comma, "the") predicts what follows it poorly: in free prose most of its drafts are
rejected, and a verify window costs more than the decode step it replaces, so drafting
from it makes decoding slower where it cannot help.
"""
from __future__ import annotations

MIN_NGRAM = 2  # the shortest match the engine drafts from


# --8<-- [start:prompt_lookup]
def prompt_lookup(history: list[int], n_draft: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to n_draft tokens that followed an earlier occurrence of a suffix of `history`
    (min_ngram to max_ngram tokens): the longest suffix, latest occurrence first, that
    n_draft tokens follow; failing that, the occurrence followed by the most tokens (the
    latest occurrences of a repeated run overlap the suffix itself and have few after
    them); [] when no such suffix occurs earlier."""
    best = []
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):  # starts before the suffix's own, latest first
            if history[i:i + n] == suffix:
                follows = history[i + n:i + n + n_draft]
                if len(follows) == n_draft:
                    return follows
                best = max(best, follows, key=len)
    return best
# --8<-- [end:prompt_lookup]


# --8<-- [start:drafter]
class Drafter:
    """prompt_lookup's drafts, found through an index instead of a scan: for each n-gram
    length up to max_ngram, where each n-gram starts, kept as the history grows. A scan
    costs a Python comparison per token of the history per window (milliseconds at a few
    thousand tokens, more than a replayed window takes on a GPU); a lookup here visits
    only the suffix's earlier occurrences, latest first, in prompt_lookup's order, so the
    drafts are the same (tests/test_speculation.py checks them against it)."""

    def __init__(self, history: list[int], max_ngram: int, min_ngram: int = 1):
        self.history: list[int] = []
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.starts = [dict() for _ in range(max_ngram + 1)]  # starts[n][n-gram] = [its starts, ascending]
        self.extend(history)

    def extend(self, tokens):
        for t in tokens:
            self.history.append(int(t))
            end = len(self.history)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.starts[n].setdefault(tuple(self.history[end - n:]), []).append(end - n)

    def draft(self, n_draft: int) -> list[int]:
        """prompt_lookup(self.history, n_draft, max_ngram, min_ngram)."""
        h, best = self.history, []
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            starts = self.starts[n].get(tuple(h[-n:]), ())
            for j in range(len(starts) - 2, -1, -1):  # latest first; the last start is the suffix itself
                i = starts[j]
                follows = h[i + n:i + n + n_draft]
                if len(follows) == n_draft:
                    return follows
                best = max(best, follows, key=len)
        return best
# --8<-- [end:drafter]


# --8<-- [start:window_width]
class WindowWidth:
    """How many positions the next verify window holds: 2, 4, ... (powers of two) up to
    --spec, starting at --spec. A window whose drafts were all kept is followed by the next
    wider one; one that kept fewer than half of what it could is followed by the next
    narrower one. A wide window costs more than a narrow one (more rows through every
    product and attention), which pays only while the drafts keep being right: in a reply
    that copies its prompt the width stays at --spec, in free prose it falls to where the
    few drafts that are right still gain more than the pass costs."""

    def __init__(self, spec: int):
        self.widths = sorted({w for w in (2, 4, 8) if w < spec} | {spec})
        self.i = len(self.widths) - 1

    @property
    def now(self) -> int:
        return self.widths[self.i]

    def after(self, kept: int):
        """The window of `now` positions kept `kept` of its drafts."""
        if kept == self.now - 1:
            self.i = min(self.i + 1, len(self.widths) - 1)
        elif 2 * kept < self.now - 1:
            self.i = max(self.i - 1, 0)
# --8<-- [end:window_width]
