"""`strata-nb compare-kv`: what each KV format (and QSA budget) costs in quality.

Teacher-forced over one text, every compared engine reads the same tokens as a reference
engine with a float32 KV cache and dense attention. Per position we compare the next-token
distributions: KL(reference || format), whether the top-1 tokens agree, and the
log-likelihood of the true next token, which gives each engine's perplexity on the text.
The engines run chunk by chunk in lockstep so only one chunk of logits per engine is held.
"""
from __future__ import annotations

import numpy as np

from ..kv_layout import BLOCK


def log_softmax(x: np.ndarray) -> np.ndarray:
    """x (n, vocab) logits -> (n, vocab) float64 log-probabilities."""
    x = x.astype(np.float64)  # float64: KL sums many tiny differences
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# --8<-- [start:compare_kv]
def compare_kv(base, ids: list[int], formats: list[str], budgets: list[int], progress=None) -> dict:
    """base: an Engine (its model and weights are shared). Returns the table as a dict."""
    cells = max(len(ids), BLOCK)  # a cache holds whole blocks
    reference = base.derive(kv="fp32", kv_resident=0, qsa_budget=0, max_context=cells, fault="none")
    rows = [(fmt, b, base.derive(kv=fmt, qsa_budget=b, max_context=cells)) for fmt in formats for b in budgets]
    compared = [Rows(e.score_chunks(ids, windows_from=b or None)) for _, b, e in rows]
    target = np.asarray(ids[1:] + [-1])  # row p predicts token p + 1 (the last row predicts nothing)
    ref_nll, acc = [], [dict(kl=[], top1=[], nll=[]) for _ in rows]
    for start, ref_logits in reference.score_chunks(ids):
        n = len(ref_logits)
        lp_ref = log_softmax(ref_logits)
        t = target[start:start + n]
        valid = t >= 0
        ref_nll.append(-lp_ref[valid, t[valid]])
        for a, rows_of in zip(acc, compared):
            lp = log_softmax(rows_of.take(n))
            a["kl"].append((np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1))
            a["top1"].append(lp.argmax(-1) == lp_ref.argmax(-1))
            a["nll"].append(-lp[valid, t[valid]])
        if progress:
            progress(n)
    ref_ppl = float(np.exp(np.concatenate(ref_nll).mean()))
    table = []
    for (fmt, b, _), a in zip(rows, acc):
        kl, nll = np.concatenate(a["kl"]), np.concatenate(a["nll"])
        ppl = float(np.exp(nll.mean()))
        table.append(dict(kv=fmt, qsa_budget=b, mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                          top1_agreement=float(np.concatenate(a["top1"]).mean()), ppl=ppl,
                          ppl_change=ppl / ref_ppl - 1.0))
    return dict(tokens=len(ids), reference=dict(kv="fp32", qsa_budget=0, ppl=ref_ppl), rows=table)
# --8<-- [end:compare_kv]


class Rows:
    """Logit rows from a chunk stream, handed out n at a time whatever its chunk sizes."""

    def __init__(self, chunks):
        self.chunks, self.pending = chunks, []

    def take(self, n: int) -> np.ndarray:
        have = sum(len(c) for c in self.pending)
        while have < n:
            _, logits = next(self.chunks)
            self.pending.append(logits)
            have += len(logits)
        rows = np.concatenate(self.pending)
        self.pending = [rows[n:]] if have > n else []
        return rows[:n]


def format_table(result: dict) -> str:
    lines = [f"{result['tokens']} tokens, teacher-forced; reference: fp32 KV, dense attention, "
             f"perplexity {result['reference']['ppl']:.3f}",
             "",
             f"{'format':<7} {'qsa':>5} {'mean KL':>9} {'max KL':>8} {'top-1':>7} {'ppl':>8} {'ppl change':>10}",
             "-" * 60]
    for r in result["rows"]:
        qsa = str(r["qsa_budget"]) if r["qsa_budget"] else "all"
        lines.append(f"{r['kv']:<7} {qsa:>5} {r['mean_kl']:>9.5f} {r['max_kl']:>8.4f} "
                     f"{100 * r['top1_agreement']:>6.2f}% {r['ppl']:>8.3f} {100 * r['ppl_change']:>+9.2f}%")
    return "\n".join(lines)
