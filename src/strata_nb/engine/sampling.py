"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import numpy as np

from ..settings import SamplingSettings


# --8<-- [start:sample]
def sample(logits: np.ndarray, s: SamplingSettings, rng: np.random.Generator) -> int:
    """logits (vocab,) float32 -> one token id."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature  # float64: exp of large logits stays exact enough
    if s.top_k and s.top_k < z.size:
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, s.top_p)) + 1]  # smallest set with mass >= top_p
        kept = np.zeros_like(p)
        kept[keep] = p[keep]
        p = kept / kept.sum()
    return int(rng.choice(p.size, p=p))
# --8<-- [end:sample]
