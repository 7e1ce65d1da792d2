"""Prompt-lookup drafting: guess the next tokens by finding the last few tokens earlier in
the text (the prompt and the output so far) and copying what followed them there.

A reply that quotes, edits or summarizes its prompt repeats long runs of it; when the last
n tokens occurred before, the tokens after that occurrence are a cheap guess at what comes
next. The model then checks the guesses in one batched pass (engine.py, `verify`): each
one it agrees with is a token gained without a step of its own. Longer matches are tried
first (up to `max_ngram`), and among equal lengths the most recent occurrence.
"""
from __future__ import annotations


# --8<-- [start:prompt_lookup]
def prompt_lookup(history: list[int], n_draft: int, max_ngram: int) -> list[int]:
    """Up to n_draft tokens that followed an earlier occurrence of a suffix of `history`
    (at most max_ngram tokens): the longest suffix, latest occurrence first, that n_draft
    tokens follow; failing that, the occurrence followed by the most tokens (the latest
    occurrences of a repeated run overlap the suffix itself and have few after them);
    [] when no suffix occurs earlier."""
    best = []
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):  # starts before the suffix's own, latest first
            if history[i:i + n] == suffix:
                follows = history[i + n:i + n + n_draft]
                if len(follows) == n_draft:
                    return follows
                best = max(best, follows, key=len)
    return best
# --8<-- [end:prompt_lookup]
